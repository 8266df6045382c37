# ruff: noqa  (a one-off driver, kept as it ran on the device; formatted since)
"""One-off: an 8B- and a 1B-shaped Llama (random bf16 weights, no download) on the GPU: the
forward of a verify pass (16 sessions x 5 tokens over 512 cached) and of a draft step (16 x 1),
to compare with the sampling math's time at vocab 128,256 x batch 16."""

import json
import os
import statistics
import time
import traceback

import torch
from transformers import LlamaConfig, LlamaForCausalLM

out = os.environ.get("OUT", ".")
res = {}


def med(fn, n=10):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(1000 * (time.perf_counter() - t))
    return statistics.median(ts)


shapes = {
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
}
torch.set_default_dtype(torch.bfloat16)
for name, shape in shapes.items():
    try:
        cfg = LlamaConfig(vocab_size=128256, max_position_embeddings=4096, **shape)
        t0 = time.time()
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).eval()
        r = {
            "init_s": round(time.time() - t0, 1),
            "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
        }
        with torch.inference_mode():
            ids = torch.randint(0, 128256, (16, 512), device="cuda")
            pre = model(input_ids=ids, use_cache=True)
            past = pre.past_key_values
            for tokens in (5, 1):
                step = torch.randint(0, 128256, (16, tokens), device="cuda")

                def fwd():
                    # the same cache each time: the pass's tokens cropped off again
                    o = model(input_ids=step, past_key_values=past, use_cache=True)
                    past.crop(-tokens)
                    return o.logits

                r[f"forward_16x{tokens}_ms"] = med(fwd)
        res[name] = r
        print(name, json.dumps(r), flush=True)
        del model, pre, past
        torch.cuda.empty_cache()
    except Exception:
        traceback.print_exc()
json.dump(res, open(os.path.join(out, "forward.json"), "w"), indent=1)
