"""Load generator for the specdec stack: closed-loop clients over the public gRPC API.

Each request goes through `GenerateStream`, so time to first token is measured on the client
(when the first chunk with tokens arrives), not taken from the server's own stats. At
concurrency C, C client slots each send their next prompt as soon as the previous one is done.
`BenchStack` is the local stack the benchmark measures, restarted when a process dies.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from google.protobuf.json_format import MessageToDict

from specdec.launcher.stack import Stack, StackSettings
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


def request_for(
    prompt: list[int], mode: dict, gamma: int | None, max_new_tokens: int, seed: int
) -> coordinator_pb2.GenerateRequest:
    """One benchmark request; gamma None leaves γ to the server's adaptive policy."""
    speculation = coordinator_pb2.SpeculationParams()
    if gamma is not None:
        speculation.num_speculative_tokens = gamma
    sampling = common_pb2.SamplingParams(
        temperature=mode["temperature"],
        top_p=mode["top_p"] if mode["temperature"] > 0 else 0.0,
        seed=seed,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,  # every request yields exactly max_new_tokens, as for the HF peers
    )
    return coordinator_pb2.GenerateRequest(
        prompt_token_ids=prompt, sampling=sampling, speculation=speculation
    )


async def stream_one(stub, request, timeout_s: float) -> dict:
    start = time.perf_counter()
    first = None
    first_chunk_tokens = 0
    token_ids: list[int] = []
    stats = None
    async for chunk in stub.GenerateStream(request, timeout=timeout_s):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
            first_chunk_tokens = len(chunk.token_ids)
        token_ids.extend(chunk.token_ids)
        if chunk.finish_reason:
            stats = MessageToDict(
                chunk.stats,
                preserving_proto_field_name=True,
                always_print_fields_with_no_presence=True,
            )
    end = time.perf_counter()
    return {
        "start": start,
        "latency_s": end - start,
        "ttft_s": (first or end) - start,
        "first_chunk_tokens": first_chunk_tokens,
        "generated_tokens": len(token_ids),
        "token_ids": token_ids,
        "stats": stats or {},
    }


async def run_load(
    address: str,
    prompts: list[list[int]],
    mode: dict,
    gamma: int | None,
    max_new_tokens: int,
    concurrency: int,
    timeout_s: float,
) -> dict:
    """Send every prompt with at most `concurrency` in flight; per-request records + wall time."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        slots = asyncio.Semaphore(concurrency)

        async def one(i: int, prompt: list[int]) -> dict:
            async with slots:
                request = request_for(prompt, mode, gamma, max_new_tokens, seed=1000 + i)
                return await stream_one(stub, request, timeout_s)

        run_start = time.perf_counter()
        records = await asyncio.wait_for(
            asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), timeout=timeout_s
        )
        wall = time.perf_counter() - run_start
    return {"wall_s": wall, "requests": list(records)}


def run_load_sync(*args, **kwargs) -> dict:
    return asyncio.run(run_load(*args, **kwargs))


class StackDied(RuntimeError):
    """A process of the stack exited (or was killed from outside) during a measurement."""


class BenchStack:
    """The local stack for the benchmark; restarted when one of its processes dies."""

    def __init__(
        self, args, prompts, log, warmups: list[tuple[dict, int | None]], target_threads: int = 0
    ):
        self.args, self.prompts, self.log = args, prompts, log
        self.warmups = warmups  # (mode, γ) of every contender: each is run once, batched
        # default: the benchmark's split (`--split`); speculation off on all threads: more
        self.target_threads = target_threads or args.target_threads
        self.stack = None

    def start(self) -> None:
        args = self.args
        self.stack = Stack(
            StackSettings(
                target_model=args.target_model,
                draft_model=args.draft_model,
                port=0,
                host="127.0.0.1",
                draft_threads=args.draft_threads,
                target_threads=self.target_threads,
                coordinator_args=["--pipeline", args.pipeline],
                target_args=["--linear-kernel", args.linear_kernel, "--cpu-bind", args.cpu_bind],
                draft_args=["--linear-kernel", args.linear_kernel],
            )
        )
        self.stack.start(progress=lambda msg: self.log(f"  {msg}"))
        top = max(args.concurrency)
        for mode, gamma in self.warmups:
            run_load_sync(
                self.stack.address, self.prompts[:top], mode, gamma, 16, top, args.timeout_s
            )
        self.log("  warmed up (each mode and γ it measures, 16 tokens)")

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()

    def measure(self, mode: dict, gamma: int | None, concurrency: int) -> dict:
        """One configuration; if the stack dies meanwhile, restart it and measure again once."""
        for attempt in range(2):
            try:
                run = run_load_sync(
                    self.stack.address,
                    self.prompts,
                    mode,
                    gamma,
                    self.args.max_new_tokens,
                    concurrency,
                    self.args.timeout_s,
                )
                dead = self.stack.dead_children()
                if dead:
                    raise StackDied(f"{dead[0].name} exited with code {dead[0].process.returncode}")
                return run
            except (grpc.RpcError, StackDied) as exc:
                if attempt == 1:
                    raise
                self.log(f"  the stack failed ({str(exc).splitlines()[0]}); restarting it")
                self.stop()
                self.start()
        raise AssertionError("unreachable")
