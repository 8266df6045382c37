"""Incremental detokenisation and stop conditions against a real byte-level BPE tokenizer."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdec.text.detok import (
    FinishReason,
    IncrementalDetokenizer,
    OutputStream,
    StopChecker,
    check_stop_tokens,
)

EOS = "<|endoftext|>"
WORDS = ["héllo", "wörld", "日本語", "🙂", "emoji", "the", "quick", "brown", "fox", "naïve"]
WORDS += ["café", "Straße", "über", "中文", "한국어", "👍🏽", "stop", "END", "###", "\n"]
SAMPLES = ["héllo wörld 日本語 🙂 emoji", "the naïve fox said ### END", "中文 한국어 👍🏽 über"]


def _train_tokenizer() -> PreTrainedTokenizerFast:
    rng = random.Random(0)
    lines = [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


TOKENIZER = _train_tokenizer()  # module level: hypothesis tests cannot take function fixtures
VOCAB = len(TOKENIZER)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_BYTE_CHARS = _bytes_to_unicode()


def _byte_tokens(text: str) -> list[int]:
    """Token ids that spell `text` one UTF-8 byte per token (splitting multi-byte characters)."""
    return TOKENIZER.convert_tokens_to_ids([_BYTE_CHARS[b] for b in text.encode()])


def _train_metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-style pieces: the decoder drops the leading "▁" of the whole text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", EOS], show_progress=False
    )
    rng = random.Random(1)
    tok.train_from_iterator([" ".join(rng.choices(WORDS, k=6)) for _ in range(100)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="<unk>")


METASPACE = _train_metaspace_tokenizer()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return TOKENIZER


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    pieces, i = [], 0
    for size in chunks:
        pieces.append(detok.push(ids[i : i + size]))
        i += size
    pieces.append(detok.push(ids[i:]))
    pieces.append(detok.flush())
    return pieces


def test_byte_tokens_split_characters(tokenizer):
    ids = _byte_tokens("日本")
    assert len(ids) == 6
    assert tokenizer.decode(ids) == "日本"
    assert tokenizer.decode(ids[:2]).endswith("\ufffd")


@settings(derandomize=True, max_examples=150, deadline=None)
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=40),
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    chunks=st.lists(st.integers(1, 5), max_size=10),
    skip=st.booleans(),
)
def test_stream_equals_full_decode_random_tokens(ids, prompt, chunks, skip):
    detok = IncrementalDetokenizer(TOKENIZER, prompt, skip_special_tokens=skip)
    pieces = _stream(detok, ids, chunks)
    assert "".join(pieces) == TOKENIZER.decode(ids, skip_special_tokens=skip)
    assert detok.generated_token_ids == ids


def test_context_dependent_pieces_keep_their_spaces():
    ids = METASPACE.encode("the quick fox")
    assert [METASPACE.decode([i]) for i in ids] == ["the", "quick", "fox"]  # alone: no spaces
    detok = IncrementalDetokenizer(METASPACE, METASPACE.encode("a prompt"))
    assert [detok.push([i]) for i in ids] + [detok.flush()] == ["the", " quick", " fox", ""]


@settings(derandomize=True, max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, len(METASPACE) - 1), max_size=30))
def test_stream_equals_full_decode_metaspace(ids):
    detok = IncrementalDetokenizer(METASPACE, [3, 4])
    text = METASPACE.decode(ids, skip_special_tokens=True)
    assert "".join([detok.push([i]) for i in ids] + [detok.flush()]) == text


@settings(derandomize=True, max_examples=100, deadline=None)
@given(
    words=st.lists(st.sampled_from(WORDS + ["x", " ", "ß", "€"]), min_size=1, max_size=12),
    split=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_split_multibyte_characters_never_emit_partials(words, split):
    """Valid text, some words spelled byte by byte: every piece is valid, final text."""
    ids = []
    for word, by_byte in zip(words, split, strict=False):
        ids += _byte_tokens(word) if by_byte else TOKENIZER.encode(word)
    text = "".join(words)
    detok = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("prompt 日"))
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[-1] == ""  # valid text is fully released before flush


def test_partial_character_is_held_then_released(tokenizer):
    ids = _byte_tokens("🙂")  # 4 bytes
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.push([i]) for i in ids] == ["", "", "", "🙂"]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.push(ids[:3]) == ""
    assert detok.flush() == "\ufffd"  # what tokenizer.decode gives for the truncated bytes


def test_eos_text_follows_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("héllo") + [tokenizer.eos_token_id]
    assert "".join(_stream(IncrementalDetokenizer(tokenizer, []), ids, [1] * 9)) == "héllo"
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(_stream(detok, ids, [1] * 9)) == "héllo" + EOS


@pytest.mark.parametrize(
    ("stop", "pushes", "expected"),
    [
        (["###"], ["a #", "#", "# b"], ["a ", "", ""]),  # spans three pushes
        (["END"], ["x E", "ND y"], ["x ", ""]),
        (["ab", "b"], ["xab"], ["x"]),  # earliest occurrence wins
        (["日本"], ["é日", "本語"], ["é", ""]),
    ],
)
def test_stop_string_spanning_pushes_is_cut(stop, pushes, expected):
    checker = StopChecker(stop)
    out = [checker.feed(p) for p in pushes]
    assert [text for text, _ in out] == expected
    assert out[-1][1]
    assert checker.feed("more")[0] == "" and checker.flush() == ""


def test_partial_stop_prefix_is_held_then_released():
    checker = StopChecker(["stop!", "END"])
    assert checker.feed("go st") == ("go ", False)
    assert checker.held == "st"
    assert checker.feed("o") == ("", False)
    assert checker.feed("p?") == ("stop?", False)  # not a stop: released in order
    assert checker.feed("E") == ("", False)
    assert checker.flush() == "E"


def test_stop_string_across_tokens_in_output_stream(tokenizer):
    prompt = tokenizer.encode("the")
    ids = tokenizer.encode(" fox said") + _byte_tokens(" ##") + _byte_tokens("# END")
    stream = OutputStream(tokenizer, prompt, stop=["###"])
    steps = [stream.push(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    text = "".join(s.text for s in steps)
    assert text == " fox said "
    assert "#" not in text
    committed = ids[: sum(s.num_tokens for s in steps)]
    assert tokenizer.decode(committed).endswith("###")  # the completing token is kept
    assert steps[-1].finish_reason == FinishReason.STOP
    assert stream.push(ids).num_tokens == 0


def test_output_stream_held_prefix_released_at_length(tokenizer):
    ids = tokenizer.encode("the fox") + _byte_tokens(" #")
    stream = OutputStream(tokenizer, [], stop=["##"], max_new_tokens=len(ids))
    step = stream.push(ids)
    assert step.finish_reason == FinishReason.LENGTH
    assert step.text == "the fox #"


def test_check_stop_tokens():
    assert check_stop_tokens([5, 6, 7]) == (3, None)
    assert check_stop_tokens([5, 0, 7], eos_token_ids={0}) == (2, FinishReason.EOS)
    assert check_stop_tokens([5, 0, 7], eos_token_ids={0}, ignore_eos=True) == (3, None)
    assert check_stop_tokens([5, 6, 7], stop_token_ids={6}) == (2, FinishReason.STOP)
    assert check_stop_tokens([0], eos_token_ids={0}, stop_token_ids={0}) == (1, FinishReason.EOS)
    assert check_stop_tokens([0], eos_token_ids={0}, stop_token_ids={0}, ignore_eos=True) == (
        1,
        FinishReason.STOP,
    )
    assert check_stop_tokens([5, 6, 7], max_tokens=2) == (2, FinishReason.LENGTH)
    assert check_stop_tokens([5, 6, 7], stop_token_ids={6}, max_tokens=2) == (
        2,
        FinishReason.STOP,
    )
    assert check_stop_tokens([5], max_tokens=0) == (0, FinishReason.LENGTH)


def test_output_stream_eos_and_ignore_eos(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("héllo") + [eos] + tokenizer.encode(" wörld")
    step = OutputStream(tokenizer, []).push(ids)
    assert step.num_tokens == len(tokenizer.encode("héllo")) + 1  # EOS is committed
    assert step.text == "héllo"  # but has no text
    assert step.finish_reason == FinishReason.EOS

    step = OutputStream(tokenizer, [], ignore_eos=True).push(ids)
    assert (step.num_tokens, step.finish_reason) == (len(ids), None)
    assert step.text == "héllo wörld"


def test_output_stream_stop_token_id_is_returned(tokenizer):
    ids = tokenizer.encode("the quick brown fox")
    stream = OutputStream(tokenizer, [], stop_token_ids=[ids[2]])
    step = stream.push(ids)
    assert step.num_tokens == 3
    assert step.finish_reason == FinishReason.STOP
    assert step.text == tokenizer.decode(ids[:3])


def test_finish_reason_mirrors_proto_numbers():
    assert [r.value for r in FinishReason] == [1, 2, 3, 4]
    assert [r.name for r in FinishReason] == ["LENGTH", "EOS", "STOP", "CANCELLED"]
