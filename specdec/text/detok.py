"""Incremental detokenisation and stop conditions for streaming.

The coordinator commits a round's tokens at once and must stream only text that is final:

- `IncrementalDetokenizer` turns committed token ids into text the way vLLM and TGI do it.
  It decodes the window `prefix_offset..read_offset` and the window `prefix_offset..end`
  and emits the difference, so tokenizers whose pieces change with context (SentencePiece
  leading spaces, byte-level BPE) stream correctly. While the decoded window ends in U+FFFD
  (an incomplete UTF-8 sequence) the text is held back. The concatenation of all pushes and
  the final `flush()` equals `tokenizer.decode(generated_ids, skip_special_tokens=...)`,
  the text of the non-streaming response: windows start at the first generated token, so
  the prompt never changes the generated text.
- `StopChecker` finds stop strings in the streamed text, also when one spans several pushes,
  and holds back a suffix that could still grow into a stop string, so nothing at or past
  a stop string ever reaches a client.
- `check_stop_tokens` ends a round's tokens at EOS (unless `ignore_eos`), a stop token id or
  the length limit. The ending token is kept in `token_ids`; EOS contributes no text when
  special tokens are skipped.
- `OutputStream` combines the three, token by token, for one request: each committed token
  carries the text that became final with it, and `tail()` is what `finish()` would still
  release. The coordinator stores both with the tokens, so text is produced once per token.

`FinishReason` mirrors `specdec.v1.FinishReason` value for value (0 = unspecified is `None`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.text.tokenizer import eos_token_ids as tokenizer_eos

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"


class FinishReason(enum.IntEnum):
    """Why a generation ended; values equal the proto's `FINISH_REASON_*` numbers."""

    LENGTH = 1
    EOS = 2
    STOP = 3
    CANCELLED = 4


class IncrementalDetokenizer:
    """Streams the text of generated tokens, emitting only text that later tokens cannot change."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Absolute offsets into prompt + generated tokens, as in vLLM.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.prompt_len = len(self.token_ids)
        self.prefix_offset = self.prompt_len
        self.read_offset = self.prompt_len
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])

    @property
    def generated_token_ids(self) -> list[int]:
        """Generated tokens pushed so far."""
        return self.token_ids[self.prompt_len :]

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Iterable[int]) -> str:
        """Append committed tokens; return the text that became final with them."""
        pieces = []
        for token_id in token_ids:
            self.token_ids.append(int(token_id))
            pieces.append(self._step(final=False))
        return "".join(pieces)

    def flush(self) -> str:
        """Return the text still held back (e.g. a trailing incomplete character)."""
        return self._step(final=True)

    def peek_flush(self) -> str:
        """What `flush()` would return, without changing any state."""
        if self.read_offset == len(self.token_ids):
            return ""
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        return new_text[len(self._prefix_text) :] if len(new_text) > len(self._prefix_text) else ""

    def _step(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(self._prefix_text):
            return ""
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # an incomplete UTF-8 sequence: wait for the bytes that complete it
        emitted = new_text[len(self._prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        return emitted


class StopChecker:
    """Cuts streamed text before the first stop string and holds back possible stop prefixes."""

    def __init__(self, stop: Iterable[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.held = ""  # emitted-by-detokenizer text not yet released to the client
        self.stopped_on: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Add new text; return (text safe to stream, whether a stop string was hit).

        On a hit the returned text ends just before the stop string; nothing after it is
        ever returned, and later calls return ("", True).
        """
        if self.stopped_on is not None:
            return "", True
        buf = self.held + text
        hit = min(
            ((i, s) for s in self.stop if (i := buf.find(s)) >= 0),
            default=None,
            key=lambda hit: hit[0],
        )
        if hit is not None:
            self.held = ""
            self.stopped_on = hit[1]
            return buf[: hit[0]], True
        keep = self._partial_stop_len(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release the held-back text at the end of a generation that did not stop on text."""
        held, self.held = self.held, ""
        return "" if self.stopped_on is not None else held

    def peek(self, text: str) -> str:
        """What `feed(text)` then `flush()` would release, without changing any state."""
        if self.stopped_on is not None:
            return ""
        buf = self.held + text
        hits = [i for s in self.stop if (i := buf.find(s)) >= 0]
        return buf[: min(hits)] if hits else buf

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self.stop), default=0)
        for n in range(min(len(buf), longest - 1), 0, -1):
            suffix = buf[-n:]
            if any(s.startswith(suffix) for s in self.stop):
                return n
        return 0


def check_stop_tokens(
    token_ids: Sequence[int],
    *,
    eos_token_ids: Collection[int] = (),
    stop_token_ids: Collection[int] = (),
    ignore_eos: bool = False,
    max_tokens: int | None = None,
) -> tuple[int, FinishReason | None]:
    """Return (how many of `token_ids` to keep, finish reason or None).

    The ending token (EOS or stop token id) is kept. `max_tokens` is the remaining length
    budget; reaching it ends with LENGTH. EOS wins over STOP when a token is both.
    """
    if max_tokens is not None and max_tokens <= 0:
        return 0, FinishReason.LENGTH
    for i, token_id in enumerate(token_ids):
        if token_id in eos_token_ids and not ignore_eos:
            return i + 1, FinishReason.EOS
        if token_id in stop_token_ids:
            return i + 1, FinishReason.STOP
        if max_tokens is not None and i + 1 >= max_tokens:
            return i + 1, FinishReason.LENGTH
    return len(token_ids), None


@dataclass(frozen=True)
class StreamStep:
    """What one `OutputStream.push` commits and streams."""

    num_tokens: int  # how many of the pushed tokens to commit
    texts: tuple[str, ...]  # per committed token, the text that became final with it
    finish_reason: FinishReason | None
    tail: str = ""  # text released by the end of the stream (after the last token's)

    @property
    def text(self) -> str:
        """Text final and safe to stream now."""
        return "".join(self.texts) + self.tail


class OutputStream:
    """Applies stop tokens, the length limit, detokenisation and stop strings for one request."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        stop: Iterable[str] = (),
        stop_token_ids: Collection[int] = (),
        eos_token_ids: Collection[int] | None = None,
        ignore_eos: bool = False,
        max_new_tokens: int | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        if eos_token_ids is None:
            eos_token_ids = tokenizer_eos(tokenizer)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.ignore_eos = ignore_eos
        self.max_new_tokens = max_new_tokens
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        self.stop_checker = StopChecker(stop)
        self.num_generated = 0
        self.finish_reason: FinishReason | None = None

    def push(self, token_ids: Sequence[int]) -> StreamStep:
        """Offer a round's tokens; return how many to commit, their text, and the end."""
        if self.finish_reason is not None:
            return StreamStep(0, (), self.finish_reason)
        remaining = (
            None if self.max_new_tokens is None else self.max_new_tokens - self.num_generated
        )
        num_tokens, reason = check_stop_tokens(
            token_ids,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=remaining,
        )
        texts = []
        for i in range(num_tokens):
            text, hit = self.stop_checker.feed(self.detokenizer.push(token_ids[i : i + 1]))
            texts.append(text)
            if hit:
                num_tokens, reason = i + 1, FinishReason.STOP
                break
        self.num_generated += num_tokens
        tail = self.finish(reason) if reason is not None else ""
        return StreamStep(num_tokens, tuple(texts), self.finish_reason, tail)

    def tail(self) -> str:
        """The text `finish()` would release now (held-back text), without finishing."""
        if self.finish_reason is not None:
            return ""
        return self.stop_checker.peek(self.detokenizer.peek_flush())

    def finish(self, reason: FinishReason) -> str:
        """End the stream (e.g. CANCELLED); return the remaining text to stream.

        A stop string found in the flushed text still cuts it and makes the reason STOP.
        """
        if self.finish_reason is not None:
            return ""
        text, hit = self.stop_checker.feed(self.detokenizer.flush())
        self.finish_reason = FinishReason.STOP if hit else reason
        return text + self.stop_checker.flush()
