"""Corpus, tokenizer and batches of the code pair (models/train.py): CPython stdlib .py files split
by file into train / held-out, the byte-level BPE trained on the train split, and training
windows that are a pure function of (step, salt)."""

import hashlib
import os
import sysconfig
import time
from pathlib import Path

import torch

SEED = 1234
SEQ = 256
BATCH = 8
VOCAB = 8192
EOS = "<|endoftext|>"
MAX_FILE_BYTES = 300_000  # skip a few huge generated files (e.g. pydoc_data/topics.py)
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def atomic_save(obj, path):
    tmp = Path(str(path) + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- corpus
def corpus_files():
    """Sorted (relative path, text) of stdlib .py files, minus tests/site-packages/huge files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if SKIP_DIRS & set(rel.split("/")[:-1]) or not p.is_file():
            continue
        raw = p.read_bytes()
        if len(raw) > MAX_FILE_BYTES:
            continue
        try:
            out.append((rel, raw.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return out


def is_heldout(rel):
    """~5% of files, chosen by a stable hash of the relative path."""
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 20 == 0


# ----------------------------------------------------------------------------- tokenizer + data
def build_tokenizer_and_data(out, work):
    """Train the BPE on the train split, save it to OUT/{target,draft}, tokenize both splits."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    data_path = work / "data.pt"
    files = corpus_files()
    train = [(r, t) for r, t in files if not is_heldout(r)]
    held = [(r, t) for r, t in files if is_heldout(r)]
    (out / "heldout_files.txt").write_text("".join(r + "\n" for r, _ in held))
    tok_path = work / "tokenizer.json"
    if not tok_path.exists():
        t0 = time.time()
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=[EOS],
            min_frequency=2,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator([t for _, t in train], trainer)
        tok.save(str(tok_path))
        log(f"tokenizer trained in {time.time() - t0:.0f}s on {len(train)} files")
    tok = Tokenizer.from_file(str(tok_path))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    for name in ("target", "draft"):
        hf.save_pretrained(out / name)
    if data_path.exists():
        return torch.load(data_path)
    eos = tok.token_to_id(EOS)

    def encode(docs):
        enc = tok.encode_batch([t for _, t in docs], add_special_tokens=False)
        for (rel, text), e in zip(docs, enc):
            assert tok.decode(e.ids, skip_special_tokens=False) == text, f"round-trip failed: {rel}"
        return [torch.tensor([eos] + e.ids, dtype=torch.int16) for e in enc]

    tr, he = encode(train), encode(held)
    data = {
        "train": torch.cat(tr),
        "heldout": torch.cat(he),
        "heldout_docs": he,
        "eos": eos,
        "chars": {"train": sum(len(t) for _, t in train), "heldout": sum(len(t) for _, t in held)},
        "files": {"train": len(train), "heldout": len(held)},
    }
    atomic_save(data, data_path)
    log(
        f"data: {data['files']} files, {len(data['train'])} train / {len(data['heldout'])} held-out tokens"
    )
    return data


def get_batch(stream, step, salt):
    """Deterministic random 257-token windows: depends only on (step, salt)."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + salt * 7_919 + step)
    starts = torch.randint(0, len(stream) - SEQ - 1, (BATCH,), generator=g)
    return torch.stack([stream[s : s + SEQ + 1] for s in starts.tolist()]).long()
