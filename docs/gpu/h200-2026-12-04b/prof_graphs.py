# ruff: noqa  (a one-off driver, kept as it ran on the device; formatted since)
"""One-off: where the fixed-shape sampling verify spends its time on a GPU."""

import json
import os
import statistics
import time

import torch

from bench.gpu_math import hot_path, math_inputs
from specdec.core.graphs import SamplingGraphs
from specdec.core.processed import ProcessorParams
from specdec.core.verify import DraftBlock

dev = torch.device("cuda")
out = os.environ.get("OUT", ".")


def med(fn, n=20):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(1000 * (time.perf_counter() - t))
    return statistics.median(ts)


res = {}
with torch.inference_mode():
    for vocab, batch in ((49152, 16), (262144, 64)):
        x = {
            k: v.to(dev) if hasattr(v, "to") else v
            for k, v in math_inputs(vocab, batch, "sampling").items()
        }
        g = SamplingGraphs(dev)
        draft, verify = hot_path(math_inputs(vocab, batch, "sampling"), dev, g)
        verify()
        graph = list(g._graphs.values())[-1]
        pp = ProcessorParams.of(x["params"], device=dev)
        block = DraftBlock(x["candidates"], x["num"], x["q_ids"], x["q_w"])
        rows = x["target"].reshape(-1, vocab)
        values = {
            "rows": rows,
            "temperature": pp.temperature,
            "top_k": pp.top_k,
            "top_p": pp.top_p,
            "min_p": pp.min_p,
            "candidates": block.candidates,
            "num": block.num_candidates,
            "q_ids": block.q_ids,
            "q_weights": block.q_weights,
            "seeds": x["seeds"],
            "base": x["base"],
        }
        r = {}
        r["call_ms"] = med(verify)
        r["feed_ms"] = med(lambda: graph.feed(values))
        r["replay_ms"] = med(lambda: graph.graph.replay())
        r["readback_ms"] = med(lambda: graph.outputs[0].tolist())
        nodes = None
        try:
            nodes = graph.graph.debug_dump if False else None
        except Exception:
            pass
        # eager fixed ops (not captured), by op: where the GPU time goes
        eg = SamplingGraphs(dev, capture=False)
        _, everify = hot_path(math_inputs(vocab, batch, "sampling"), dev, eg)
        everify()
        torch.cuda.synchronize()
        r["fixed_uncaptured_ms"] = med(everify, 10)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            everify()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        rows_ = sorted(
            ka, key=lambda e: -getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))
        )
        r["top_ops"] = [
            (
                e.key,
                e.count,
                round(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1000, 3),
            )
            for e in rows_[:25]
        ]
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        r["kernels"] = len(kernels)
        r["kernel_ms_sum"] = (
            round(sum(e.device_time for e in kernels) / 1000, 3) if kernels else None
        )
        with profile(activities=[ProfilerActivity.CUDA]) as prof2:
            graph.graph.replay()
            torch.cuda.synchronize()
        k2 = [e for e in prof2.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        r["graph_kernels"] = len(k2)
        r["graph_kernel_ms_sum"] = round(sum(e.device_time for e in k2) / 1000, 3) if k2 else None
        top2 = {}
        for e in k2:
            top2[e.name[:80]] = top2.get(e.name[:80], 0) + e.device_time
        r["graph_top_kernels"] = sorted(
            ((k, round(v / 1000, 3)) for k, v in top2.items()), key=lambda t: -t[1]
        )[:25]
        res[f"{vocab}x{batch}"] = r
        print(
            json.dumps(
                {
                    f"{vocab}x{batch}": {
                        k: v for k, v in r.items() if k not in ("top_ops", "graph_top_kernels")
                    }
                }
            ),
            flush=True,
        )
json.dump(res, open(os.path.join(out, "profile.json"), "w"), indent=1)
for k, r in res.items():
    print(k)
    for t in r["graph_top_kernels"][:15]:
        print("   ", t)
    for t in r["top_ops"][:15]:
        print("  op", t)
