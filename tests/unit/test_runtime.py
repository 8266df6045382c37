"""Model runtime and KV state: cropping and batching never change what the model computes,
with attention over each session's own KV (the default on a CPU) and over a padded batch."""

from __future__ import annotations

import pytest
import torch
from tiny_models import fresh_logits

from specdec.core.prefix import common_prefix_len, fingerprint
from specdec.engine import session_attention
from specdec.engine.kv import KVSession
from specdec.engine.model import ModelRuntime, RuntimeSettings

ATOL = 1e-4


def load(model_dir: str, attention: str = "auto", kernel: str = "auto") -> ModelRuntime:
    return ModelRuntime(
        RuntimeSettings(
            model_dir, device="cpu", threads=1, batch_attention=attention, attention_kernel=kernel
        )
    )


@pytest.fixture(
    scope="module",
    params=[
        ("target", "sessions", "compiled"),
        ("target", "sessions", "torch"),
        ("target", "padded", "auto"),
        ("gpt2", "sessions", "compiled"),
        ("gpt2", "sessions", "torch"),
        ("gpt2", "padded", "auto"),
    ],
    ids="-".join,
)
def runtime(request, model_dirs) -> ModelRuntime:
    """Attention over each session's own KV (short blocks by the compiled kernel, or all by
    torch's), and over a padded batch."""
    model, attention, kernel = request.param
    return load(model_dirs[model], attention, kernel)


@pytest.fixture(scope="module", params=["target", "gpt2"])
def padded_runtime(request, model_dirs) -> ModelRuntime:
    """A runtime that keeps a padded batch copy of the sessions' KV across passes."""
    return load(model_dirs[request.param], "padded")


def test_loads_from_disk_with_tokenizer(runtime):
    assert runtime.vocab_size == len(runtime.tokenizer)
    text = "def add(a, b):\n    return a + b  # héllo 🙂"
    assert runtime.tokenizer.decode(runtime.tokenizer.encode(text)) == text
    assert len(runtime.vocab_fingerprint) == 32 and runtime.eos_token_ids


def test_prefill_append_crop_append_equals_fresh_forward(runtime):
    prompt = runtime.tokenizer.encode("for i in range(10):\n    print(")
    session = KVSession("s")
    session.sync(prompt)
    runtime.forward([session], [session.pending()])
    runtime.forward([session], [[5, 6, 7, 8]])  # candidates
    assert session.kv_len == len(prompt) + 4
    session.crop(len(prompt) + 1)  # keep one accepted candidate
    logits = runtime.forward([session], [[9, 10]])[0]  # a different continuation
    history = prompt + [5, 9, 10]
    assert session.tokens == history and session.kv_len == len(history)
    assert torch.allclose(logits, fresh_logits(runtime, history)[-2:], atol=ATOL)


def test_sync_keeps_only_the_common_prefix(runtime):
    session = KVSession("s")
    session.sync([1, 2, 3, 4, 5])
    runtime.forward([session], [session.pending()])
    assert session.sync([1, 2, 9, 4]) == 2  # KV of the diverging suffix is dropped
    assert session.pending() == [9, 4]
    logits = runtime.forward([session], [session.pending() + [7]])[0]
    assert torch.allclose(logits, fresh_logits(runtime, [1, 2, 9, 4, 7])[-3:], atol=ATOL)


def test_sync_always_feeds_the_last_token_again(runtime):
    """A history fully covered by KV still yields logits: its last token is recomputed."""
    session = KVSession("s")
    session.sync([1, 2, 3])
    runtime.forward([session], [session.pending() + [4]])
    assert session.kv_len == 4
    assert session.sync([1, 2, 3, 4]) == 3 and session.pending() == [4]
    logits = runtime.forward([session], [session.pending()])[0]
    assert torch.allclose(logits, fresh_logits(runtime, [1, 2, 3, 4])[-1:], atol=ATOL)


def test_batched_forward_equals_one_at_a_time(runtime):
    gen = torch.Generator().manual_seed(0)
    histories = [
        torch.randint(1, runtime.vocab_size, (n,), generator=gen).tolist() for n in (3, 17, 8, 30)
    ]
    extra = [
        torch.randint(1, runtime.vocab_size, (n,), generator=gen).tolist() for n in (5, 1, 3, 2)
    ]
    sessions = []
    for i, history in enumerate(histories):
        session = KVSession(str(i))
        session.sync(history[:-1])
        runtime.forward([session], [session.pending()])  # cached: all but the last token
        session.sync(history)
        sessions.append(session)
    batched = runtime.forward(sessions, [s.pending() + e for s, e in zip(sessions, extra)])
    for history, more, logits in zip(histories, extra, batched):
        expected = fresh_logits(runtime, history + more)[len(history) - 1 :]
        assert torch.allclose(logits, expected, atol=ATOL)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_rounds_of_a_batch_reuse_its_kv_and_equal_one_at_a_time(padded_runtime):
    """Verify-like rounds on the same batch: candidates in, a random number kept (crop), the
    rest become holes in the reused batch buffers; every round's logits equal a fresh forward
    of the true history. A session written elsewhere, or a new batch, gets a fresh copy."""
    runtime = padded_runtime
    gen = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(1, runtime.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    sessions = []
    for i, n in enumerate((4, 19, 9)):
        session = KVSession(str(i))
        session.sync(rand(n))
        runtime.forward([session], [session.pending()])
        sessions.append(session)
    builds = 0
    for round_ in range(12):
        if round_ == 6:  # another write to one session: its batch copy must not be used
            runtime.forward([sessions[1]], [rand(2)])
        previous = runtime._last_batch
        blocks = [
            s.pending() + rand(int(torch.randint(1, 5, (1,), generator=gen))) for s in sessions
        ]
        if round_ == 8:
            blocks[2] = rand(3)  # a session with nothing pending: feeds just candidates
        before = [list(s.tokens) for s in sessions]
        out = runtime.forward(sessions, blocks)
        builds += runtime._last_batch is not previous
        for session, history, block, logits in zip(sessions, before, blocks, out):
            full = history[: session.kv_len - len(block)] + block
            expected = fresh_logits(runtime, full)[-len(block) :]
            assert torch.allclose(logits, expected, atol=ATOL), round_
            keep = len(full) - int(torch.randint(0, len(block), (1,), generator=gen))
            session.crop(keep)  # a rejection: the tail becomes a hole in the batch buffers
    assert 2 <= builds <= 4  # the first round, after the outside write, and when full


def test_batches_that_change_every_pass_copy_no_kv_and_equal_one_at_a_time(runtime):
    """Verify-like passes over a different subset of the sessions each time (sessions finish,
    arrive, or two groups take turns on the target), blocks of different lengths, a random
    number kept: every pass's logits equal a fresh forward of the true history; with
    attention over the sessions' own KV no batch copy is ever made."""
    gen = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(1, runtime.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    sessions = []
    for i, n in enumerate((5, 21, 2, 13, 8)):
        session = KVSession(str(i))
        session.sync(rand(n))
        sessions.append(session)
    runtime.forward(sessions, [s.pending() for s in sessions])  # one prefill of 5 lengths
    for round_ in range(10):
        chosen = [s for s in sessions if torch.rand(1, generator=gen) < 0.6] or sessions[:1]
        blocks = [s.pending() + rand(int(torch.randint(1, 6, (1,), generator=gen))) for s in chosen]
        before = [list(s.tokens) for s in chosen]
        out = runtime.forward(chosen, blocks)
        for session, history, block, logits in zip(chosen, before, blocks, out):
            full = history[: session.kv_len - len(block)] + block
            expected = fresh_logits(runtime, full)[-len(block) :]
            assert torch.allclose(logits, expected, atol=ATOL), round_
            assert torch.equal(logits.argmax(-1), expected.argmax(-1)), round_
            session.crop(len(full) - int(torch.randint(0, len(block), (1,), generator=gen)))
    if runtime.session_attention:
        assert runtime.batch_kv_bytes == 0
    else:
        assert runtime.batch_kv_bytes > 0


def test_auto_attends_per_session_on_a_cpu_where_the_model_qualifies(model_dirs):
    assert load(model_dirs["target"]).session_attention
    assert not load(model_dirs["target"], "padded").session_attention


def test_a_model_with_sliding_windows_keeps_the_padded_batch(model_dirs, monkeypatch):
    """A config whose attention would need a mask the per-session path does not build."""
    real = session_attention._unfit

    def windowed(model, mode):
        model.config.sliding_window = 4
        return real(model, mode)

    monkeypatch.setattr(session_attention, "_unfit", windowed)
    assert not load(model_dirs["target"]).session_attention
    with pytest.raises(ValueError, match="batch_attention: sessions does not fit.*sliding-window"):
        load(model_dirs["target"], "sessions")


def test_the_check_at_load_catches_attention_that_is_wrong(model_dirs, monkeypatch):
    """Negative control of the check at load: torch's per-session attention without its
    causal mask (each new token would see the tokens after it) is found and not used (the
    compiled kernel's own control: tests/unit/test_attention_kernel.py)."""
    real = session_attention.SessionRows.__init__

    def unmasked(self, sessions, lengths, kernel=None):
        real(self, sessions, lengths, kernel)
        self.masks = [None] * len(sessions)

    monkeypatch.setattr(session_attention.SessionRows, "__init__", unmasked)
    assert not load(model_dirs["target"], kernel="torch").session_attention
    with pytest.raises(ValueError, match="found other logits"):
        load(model_dirs["target"], "sessions", "torch")


def test_batch_attention_names_the_field_of_a_bad_value(model_dirs):
    with pytest.raises(ValueError, match="batch_attention: expected one of"):
        load(model_dirs["target"], "paged")


def test_fingerprint_and_prefix():
    assert fingerprint([1, 2, 3]) == fingerprint([1, 2, 3])
    assert fingerprint([1, 2, 3]) != fingerprint([1, 2, 4]) != fingerprint([1, 2])
    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
