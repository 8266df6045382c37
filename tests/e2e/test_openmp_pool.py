"""One OpenMP pool a worker: at `--threads 2`, a real worker process runs every pass of its
model on its model thread, so the only OpenMP pool of the process is the model thread's
(`specdec.worker.threads`: a second pool makes every parallel region wait on a futex — a
code-target step in a worker took 20 ms against 7 in-process). Before the fix, the model was
loaded on the event loop's thread and a lone session's round ran there: that thread's pool
and the model thread's were both alive.

The worker runs under `tests/thread_probe.py`, which lists the process's OS threads on
request. An OpenMP pool's threads are native (Python does not know them) and inherit the name
of the thread that started them: the model thread's are `specdec-model`; one started by the
loop's thread — or by any other thread of Python's — carries the process's own name. The
negative control has the probe's thread run one parallel torch op: its pool must show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import pytest

from specdec.core.prefix import fingerprint
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.worker.threads import LOAD_THREAD, MODEL_THREAD

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = [5, 6, 7, 8, 9, 10]


class ProbedWorker:
    def __init__(
        self,
        role: str,
        model_dir: str,
        directory: str,
        threads: int,
        extra: tuple[str, ...] = (),
        cpus: set[int] | None = None,
    ):
        self.directory = directory
        self.address = ""  # the worker binds a free port itself (--port 0) and says which
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
        env["OMP_NUM_THREADS"] = "1"  # as the launcher starts workers: --threads sets torch's
        self.process = subprocess.Popen(
            [
                sys.executable,
                os.path.join(ROOT, "tests", "thread_probe.py"),
                directory,
                f"{role}_worker",
                "--model",
                model_dir,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--device",
                "cpu",
                "--threads",
                str(threads),
                "--log-level",
                "warning",
                *extra,
            ],
            cwd=ROOT,
            env=env,
            # the CPUs the worker may run on, as a cpuset or taskset would give them
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.seen = 0

    def wait_ready(self) -> None:
        lines = []
        for line in self.process.stdout:
            lines.append(line)
            if line.startswith("READY"):  # READY <role> <host:port>
                self.address = line.split()[2]
                return
        raise AssertionError("worker exited:\n" + "".join(lines[-40:]))

    def threads(self, command: str = "") -> list[dict]:
        self.seen += 1
        with open(os.path.join(self.directory, f"{self.seen}.go"), "w") as f:
            f.write(command)
        path = os.path.join(self.directory, f"{self.seen}.json")
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            assert time.monotonic() < deadline and self.process.poll() is None
            time.sleep(0.05)
        with open(path) as f:
            return json.load(f)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def serve_rounds(role: str, address: str) -> None:
    """What a coordinator asks of a worker at one request: a prompt, then lone small rounds
    (each ran on the loop's thread before the fix), then two sessions' rounds at once."""
    base = {"epoch": 1, "base_len": len(PROMPT), "base_fingerprint": fingerprint(PROMPT)}
    delta = common_pb2.TokenDelta(start=0, token_ids=PROMPT)
    with grpc.insecure_channel(address) as channel:
        if role == "target":
            stub = target_pb2_grpc.TargetWorkerStub(channel)

            def call(session: str):
                request = target_pb2.VerifyRequest(
                    base=common_pb2.Base(session_id=session, **base),
                    delta=delta,
                    candidate_ids=[1, 2],
                )
                return stub.Verify.future(request, timeout=60)
        else:
            stub = draft_pb2_grpc.DraftWorkerStub(channel)

            def call(session: str):
                request = draft_pb2.ProposeRequest(
                    base=common_pb2.Base(session_id=session, **base),
                    delta=delta,
                    num_speculative_tokens=3,
                )
                return stub.Propose.future(request, timeout=60)

        for i in range(4):
            call(f"lone-{i}").result()
        for future in [call("pair-a"), call("pair-b")]:
            future.result()


def stray_pool_threads(threads: list[dict]) -> list[dict]:
    """Native threads named as the process's main thread: pools started by a thread that is
    not the model thread (gRPC and torch name their own threads)."""
    main = next(t for t in threads if t["main"])
    return [t for t in threads if t["python"] is None and t["name"] == main["name"]]


@pytest.mark.parametrize("role", ["target", "draft"])
def test_one_openmp_pool_at_two_threads(role, model_dirs, tmp_path):
    worker = ProbedWorker(role, model_dirs[role], str(tmp_path), threads=2)
    try:
        worker.wait_ready()
        serve_rounds(role, worker.address)
        threads = worker.threads()
        assert stray_pool_threads(threads) == [], threads
        # the model thread's pool: the model thread and one more (2 threads)
        pool = [t for t in threads if t["name"] == MODEL_THREAD and t["python"] is None]
        assert len(pool) == 1, threads
        # the loading thread has exited (any pool it started went with it)
        assert not [t for t in threads if (t["python"] or "").startswith(LOAD_THREAD)], threads

        # negative control: a parallel region on another thread of Python's starts a pool
        assert len(stray_pool_threads(worker.threads("parallel"))) == 1
    finally:
        worker.kill()


def model_threads_cpus(threads: list[dict]) -> tuple[list[int], list[list[int]]]:
    """(the model thread's CPUs, each of its OpenMP pool threads' CPUs)."""
    model = [t for t in threads if (t["python"] or "").startswith(MODEL_THREAD)]
    pool = [t for t in threads if t["name"] == MODEL_THREAD and t["python"] is None]
    assert len(model) == 1, threads
    return model[0]["cpus"], [t["cpus"] for t in pool]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
@pytest.mark.parametrize("bind", ["auto", "reversed", "off"])
def test_cpu_bind_pins_the_model_threads(bind, model_dirs, tmp_path):
    """--cpu-bind: the model thread on the first CPU named, its pool's thread on the second;
    `auto` where the worker may run on exactly --threads CPUs (here: two, as a cpuset would
    give them); `off` (the negative control) leaves both free to run on either."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    flag = {"auto": "auto", "reversed": f"{b},{a}", "off": "off"}[bind]
    worker = ProbedWorker(
        "target", model_dirs["target"], str(tmp_path), 2, ("--cpu-bind", flag), cpus={a, b}
    )
    try:
        worker.wait_ready()
        serve_rounds("target", worker.address)  # pinned threads serve as before
        model, pool = model_threads_cpus(worker.threads())
        expected = {"auto": ([a], [[b]]), "reversed": ([b], [[a]]), "off": ([a, b], [[a, b]])}
        assert (model, pool) == expected[bind]
        main = next(t for t in worker.threads() if t["main"])
        assert main["cpus"] == [a, b]  # only the model's threads are pinned
    finally:
        worker.kill()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--threads", "2", "--cpu-bind", "0-2"], "--cpu-bind: '0-2' names 3 CPUs for --threads 2"),
        (["--threads", "1", "--cpu-bind", "4096"], "--cpu-bind: CPU 4096 is not one"),
    ],
)
def test_a_cpu_list_that_cannot_be_pinned_stops_the_worker_before_it_loads(flags, says):
    """A real worker process refuses a --cpu-bind list it cannot honour at start, naming the
    flag (exit 2, before any model is read: the model path here does not exist)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    done = subprocess.run(
        [sys.executable, "-m", "target_worker", "--model", "/nonexistent", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
    assert "/nonexistent" not in done.stderr  # refused before the model was looked at
