"""`specdec bench math --model`: the held-out prompts a pair's target is measured after are
the ones `specdec bench` sends that pair; a model of no pair gets random ids only."""

from __future__ import annotations

from transformers import AutoTokenizer

from bench.math import markdown, pair_prompts
from bench.prompts import heldout_prompts


def test_the_code_target_is_measured_after_its_pairs_held_out_files():
    got = pair_prompts("models/target", 4, 32)
    tokenizer = AutoTokenizer.from_pretrained("models/target")
    expected = heldout_prompts(tokenizer, 4, 32, "models/heldout_files.txt")[0]
    assert got == expected and len(got) == 4 and all(len(p) == 32 for p in got)


def test_a_model_of_no_pair_has_no_held_out_prompts():
    assert pair_prompts("models/draft", 4, 32) is None


def test_the_share_table_names_the_prompts():
    share = {"model": "target", "prompts": "held-out text", "vocab": 8192, "mode": "sampling"}
    share |= {"batch": 16, "forward_ms": 80.0, "verify_math_ms": 8.0, "share": 0.1}
    text = markdown([], [share], 1)
    assert "| target | held-out text | 8,192 | sampling | 16 | 80.0 | 8.0 | 10.0 % |" in text
