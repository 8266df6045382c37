"""A hostile target worker for the tests: a real gRPC server that forwards every call to a
real target worker and corrupts the output_ids of each Verify answer (a protocol-level
stand-in for a compromised or broken worker; the real worker does the actual work).

    python tests/liar_worker.py --upstream HOST:PORT --port P --mode MODE
        [--tls-cert F --tls-key F --tls-ca F]     (mTLS both ways, like a real worker)

Modes: `extra` (one token more than accepted + 1), `vocab` (an id outside the vocabulary),
`prefix` (the "accepted" tokens differ from the candidates). Prints `READY` once serving,
`VERIFY <session>` for each Verify call, `CORRUPTED <n>` after each corrupted answer and
`UPSTREAM FAILED …` when the real worker refused the call (the test's failure message
shows these lines).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.serving.security import ClientTLS, ServerTLS  # noqa: E402
from specdec.serving.server import Server, channel  # noqa: E402
from specdec.v1 import target_pb2_grpc  # noqa: E402


def corrupt(response, mode: str, vocab: int) -> None:
    out = list(response.output_ids)
    if mode == "extra":
        out.append(out[-1])
    elif mode == "vocab":
        out[-1] = vocab + 7
    elif mode == "prefix":
        if response.num_accepted == 0:  # make something "accepted" that was not proposed
            response.num_accepted = 1
            out.insert(0, (out[0] + 1) % vocab)
        else:
            out[0] = (out[0] + 1) % vocab
    del response.output_ids[:]
    response.output_ids.extend(out)


class Liar:
    def __init__(self, stub, mode: str):
        self.stub, self.mode, self.count, self.vocab = stub, mode, 0, 0

    async def Info(self, request, context):
        info = await self.stub.Info(request)
        self.vocab = info.vocab_size
        info.call_streams = False  # it proxies unary calls only
        return info

    async def Verify(self, request, context):
        print(f"VERIFY {request.base.session_id}", flush=True)
        try:
            response = await self.stub.Verify(request)
        except Exception as exc:
            print(f"UPSTREAM FAILED {exc!r}"[:300], flush=True)
            raise
        corrupt(response, self.mode, self.vocab)
        self.count += 1
        print(f"CORRUPTED {self.count}", flush=True)
        return response

    async def Prefill(self, request, context):
        return await self.stub.Prefill(request)

    async def Release(self, request, context):
        return await self.stub.Release(request)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--upstream", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=["extra", "vocab", "prefix"], required=True)
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-ca", default="")
    args = p.parse_args()
    tls = args.tls_cert and ServerTLS(args.tls_cert, args.tls_key, args.tls_ca)
    client_tls = args.tls_ca and ClientTLS(args.tls_ca, args.tls_cert, args.tls_key)
    upstream = channel(args.upstream, client_tls or None)
    name = "specdec.v1.TargetWorker"
    server = Server([name])
    server.add(Liar(target_pb2_grpc.TargetWorkerStub(upstream), args.mode), name)
    server.bind("127.0.0.1", args.port, tls or None)
    await server.start()
    await server.set_serving(True)
    print("READY", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
