"""Tokenizers from local Hugging Face model directories, loaded the same way in every tier.

A directory with a `tokenizer.json` (every fast tokenizer: Llama, Qwen, Gemma, GPT-2, …) is
loaded with `PreTrainedTokenizerFast`, which needs neither torch nor transformers' model
classes — `AutoTokenizer` would import both through the model config machinery. Only a
directory without one (a slow, sentencepiece-only tokenizer) falls back to `AutoTokenizer`.
Workers and the coordinator use this one function, so their vocabulary fingerprints agree.
"""

from __future__ import annotations

import hashlib
import json
import os


def load_tokenizer(model_dir: str):
    if not os.path.isdir(model_dir):
        raise ValueError(f"model: {model_dir!r} is not a directory")
    if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def vocab_fingerprint(tokenizer) -> str:
    """Hash of the token→id map and special tokens; equal tokenizers give equal hashes."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    payload = json.dumps([vocab, special], ensure_ascii=False).encode()
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def eos_token_ids(tokenizer) -> tuple[int, ...]:
    """The token ids that end a generation unless `ignore_eos` is set."""
    eos = tokenizer.eos_token_id
    return () if eos is None else (int(eos),)
