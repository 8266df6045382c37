"""What the full benchmark compares: the model pairs with their held-out prompts, the
sampling modes, and the contenders with the labels its tables print."""

from __future__ import annotations

import json
from pathlib import Path

MODES = (
    {"name": "greedy", "temperature": 0.0, "top_p": 1.0},
    {"name": "sampling", "temperature": 0.8, "top_p": 0.95},
)
SPECDEC = (("specdec_off", 0), ("specdec_g2", 2), ("specdec_g4", 4), ("specdec_g6", 6))
SPECDEC += (("specdec_adaptive", None),)
# speculation off as a user without a draft deploys it: the target worker on every thread the
# HF peers have (a second stack, after the others; its draft worker idles)
OFF_ALL_THREADS = "specdec_off_all_threads"
# name: (target, draft, prompts): prompts are held-out chat questions (a JSON list the draft's
# training wrote) or a list of held-out standard-library files.
PAIRS = {
    "smollm2": ("smollm2-135m-instruct", "models/smollm2-draft", "chat"),
    "code": ("models/target", "models/draft", "models/heldout_files.txt"),
}
LABELS = {
    "hf_target": "HF generate, target only",
    "hf_assisted": "HF assisted generation",
    "specdec_off": "specdec, speculation off",
    "specdec_off_all_threads": "specdec off, target all threads",
    "specdec_g2": "specdec, γ=2",
    "specdec_g4": "specdec, γ=4",
    "specdec_g6": "specdec, γ=6",
    "specdec_adaptive": "specdec, adaptive γ",
}


def chat_prompts(tokenizer, draft_model: str, count: int) -> tuple[list[list[int]], dict]:
    """Held-out chat questions (never in the draft's training data) rendered with the target's
    chat template, as token ids."""
    path = Path(draft_model) / "heldout_prompts.json"
    questions = json.loads(path.read_text())[:count]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for q in questions
    ]
    return prompts, {"source": str(path), "questions": questions, "chat_template": True}
