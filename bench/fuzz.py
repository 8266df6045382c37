"""Property-based fuzzing of a live stack: hostile public requests, raw bytes, worker calls.

    python -m bench.fuzz [--examples 10000] [--out results/fuzz]   (also: specdec bench fuzz)

Hypothesis generates random and hostile `GenerateRequest`, `GetSession` and `CancelSession`
messages, byte strings that are not protobuf, and `Propose`/`Verify`/`Prefill` calls to the
workers. Every answer must be OK or a client-error status whose message names a field — never
INTERNAL, UNKNOWN or a dead process — and a finished session under attack keeps its output.
`tests/e2e/test_fuzz.py` runs the same properties with fewer examples in `make test`.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
FIELDS = (
    "prompt",
    "sampling",
    "speculation",
    "session_id",
    "return_logprobs",
    "top_logprobs",
    "request",
    "base",
    "delta",
    "candidate_ids",
    "draft_dists",
    "num_speculative_tokens",
    "max_output_tokens",
)
VICTIM = "fuzz-victim"

u32 = st.integers(0, 2**32 - 1)
small = st.integers(0, 600)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
texts = st.text(max_size=40)
session_ids = st.one_of(
    st.just(""), st.just(VICTIM), st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True), texts
)


@st.composite
def sampling(draw) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), floats)),
        top_k=draw(st.one_of(st.just(0), u32)),
        top_p=draw(st.one_of(st.just(0.0), floats)),
        min_p=draw(st.one_of(st.just(0.0), floats)),
        max_new_tokens=draw(st.one_of(st.integers(0, 6), u32)),
        stop=draw(st.lists(texts, max_size=20)),
        stop_token_ids=draw(st.lists(st.one_of(small, u32), max_size=70)),
        ignore_eos=draw(st.booleans()),
    )
    if draw(st.booleans()):
        msg.seed = draw(st.integers(0, 2**64 - 1))
    return msg


@st.composite
def generate_requests(draw) -> coordinator_pb2.GenerateRequest:
    msg = coordinator_pb2.GenerateRequest(
        prompt=draw(st.one_of(st.just(""), texts, st.just("def f(x):"))),
        prompt_token_ids=draw(st.lists(st.one_of(small, u32), max_size=30)),
        sampling=draw(sampling()),
        session_id=draw(session_ids),
        resume_from=draw(st.one_of(st.just(0), small, u32)),
        return_logprobs=draw(st.booleans()),
        top_logprobs=draw(st.one_of(st.just(0), st.integers(0, 25), u32)),
    )
    if draw(st.booleans()):
        msg.speculation.num_speculative_tokens = draw(st.one_of(st.integers(0, 10), u32))
    return msg


@st.composite
def bases(draw):
    tokens = draw(st.lists(st.one_of(small, u32), min_size=0, max_size=40))
    base = common_pb2.Base(
        session_id=draw(session_ids),
        epoch=draw(st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1))),
        base_len=draw(st.one_of(st.just(len(tokens)), u32)),
        base_fingerprint=draw(st.one_of(st.just(b""), st.binary(max_size=20))),
    )
    delta = common_pb2.TokenDelta(start=draw(st.one_of(st.just(0), small)), token_ids=tokens)
    return base, delta


@st.composite
def plausible_bases(draw):
    """Bases a worker accepts (a full prefix of in-vocabulary tokens), to reach past checks."""
    tokens = draw(st.lists(st.integers(0, 250), min_size=1, max_size=40))
    sid = draw(st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True))
    base = common_pb2.Base(session_id=sid, epoch=draw(st.integers(0, 3)), base_len=len(tokens))
    return base, common_pb2.TokenDelta(start=0, token_ids=tokens)


plausible_sampling = st.one_of(
    st.just(common_pb2.SamplingParams()),
    st.just(common_pb2.SamplingParams(temperature=0.8, top_p=0.9)),
    sampling(),
)


@st.composite
def dists(draw):
    ids = draw(st.lists(st.one_of(small, u32), max_size=8))
    weights = draw(st.lists(st.one_of(st.integers(0, 70000), u32), max_size=8))
    return common_pb2.SparseDist(token_ids=ids, weights=weights)


def check(call, request) -> str:
    """One call; returns its status name, failing on a server error or a nameless refusal."""
    try:
        call(request, timeout=60)
        return "OK"
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        assert code in CLIENT_ERRORS, f"{code.name}: {details} for {request!r:.300}"
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert any(f in details for f in FIELDS), f"nameless refusal: {details}"
        assert len(details) < 400, "a refusal echoes the input"
        return code.name


class Fuzzer:
    """The properties, bound to a running stack's addresses."""

    def __init__(self, coordinator: str, draft: str, target: str):
        self.channels = [grpc.insecure_channel(a) for a in (coordinator, draft, target)]
        self.coordinator = coordinator_pb2_grpc.CoordinatorStub(self.channels[0])
        self.draft = draft_pb2_grpc.DraftWorkerStub(self.channels[1])
        self.target = target_pb2_grpc.TargetWorkerStub(self.channels[2])
        self.codes: collections.Counter = collections.Counter()
        victim = coordinator_pb2.GenerateRequest(
            prompt="def add(a, b):",
            session_id=VICTIM,
            sampling=common_pb2.SamplingParams(max_new_tokens=6, ignore_eos=True),
        )
        self.reference = list(self.coordinator.Generate(victim, timeout=60).token_ids)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def raw(self, method: str, payload: bytes) -> str:
        call = self.channels[0].unary_unary(
            f"/specdec.v1.Coordinator/{method}",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        return check(call, payload)

    def run(self, examples: int) -> dict:
        options = settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,  # a fixed sequence: the verdict is reproducible
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        public, raw_bytes, workers = max(1, examples // 2), max(1, examples // 5), examples

        @settings(options, max_examples=public)
        @given(generate_requests(), st.sampled_from(["Generate", "GetSession", "CancelSession"]))
        def public_api(request, method):
            if method == "Generate":
                code = check(self.coordinator.Generate, request)
            elif method == "GetSession":
                msg = coordinator_pb2.GetSessionRequest(session_id=request.session_id)
                code = check(self.coordinator.GetSession, msg)
            else:
                if request.session_id == VICTIM:
                    return  # the victim is finished; cancelling it is a no-op anyway
                msg = coordinator_pb2.CancelSessionRequest(session_id=request.session_id)
                code = check(self.coordinator.CancelSession, msg)
            self.codes[f"public {method} {code}"] += 1

        @settings(options, max_examples=raw_bytes)
        @given(st.binary(max_size=200), st.sampled_from(["Generate", "GetSession"]))
        def raw_api(payload, method):
            self.codes[f"raw {method} {self.raw(method, payload)}"] += 1

        @settings(options, max_examples=workers)
        @given(
            st.one_of(plausible_bases(), bases()),
            st.sampled_from(["Propose", "Verify", "Prefill"]),
            plausible_sampling,
            st.lists(st.one_of(st.integers(0, 250), small, u32), max_size=20),
            st.lists(dists(), max_size=20),
            st.one_of(st.integers(0, 6), u32),
        )
        def worker_api(base_delta, method, params, candidates, sparse, number):
            base, delta = base_delta
            if method == "Propose":
                msg = draft_pb2.ProposeRequest(
                    base=base, delta=delta, num_speculative_tokens=number, sampling=params, seed=1
                )
                code = check(self.draft.Propose, msg)
            elif method == "Verify":
                msg = target_pb2.VerifyRequest(
                    base=base,
                    delta=delta,
                    candidate_ids=candidates,
                    draft_dists=sparse,
                    sampling=params,
                    seed=1,
                    max_output_tokens=number,
                    return_logprobs=number % 2 == 0,
                    top_logprobs=number % 23,
                )
                code = check(self.target.Verify, msg)
            else:
                code = check(self.target.Prefill, target_pb2.PrefillRequest(base=base, delta=delta))
            self.codes[f"worker {method} {code}"] += 1

        started = time.monotonic()
        public_api()
        raw_api()
        worker_api()
        after = self.coordinator.GetSession(
            coordinator_pb2.GetSessionRequest(session_id=VICTIM), timeout=10
        )
        assert list(after.generated_token_ids) == self.reference, "the victim session changed"
        return {"examples": sum(self.codes.values()), "seconds": time.monotonic() - started}


def main(argv: list[str] | None = None) -> int:
    from specdec.launcher.stack import Stack, StackSettings

    p = argparse.ArgumentParser(prog="specdec bench fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=10_000, help="worker examples (public: half)")
    p.add_argument("--out", default="results/fuzz")
    p.add_argument("--target-model", default="models/target")
    p.add_argument("--draft-model", default="models/draft")
    args = p.parse_args(argv)
    stack_settings = StackSettings(
        args.target_model,
        args.draft_model,
        port=0,
        coordinator_args=["--default-max-new-tokens", "6"],
    )
    with Stack(stack_settings) as stack:
        fuzzer = Fuzzer(stack.address, stack.draft_addresses[0], stack.target_addresses[0])
        try:
            summary = fuzzer.run(args.examples)
        finally:
            fuzzer.close()
        dead = [c.name for c in stack.dead_children()]
    summary.update(codes=dict(sorted(fuzzer.codes.items())), dead_processes=dead)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if not dead else 1


if __name__ == "__main__":
    raise SystemExit(main())
