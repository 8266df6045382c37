"""Admission of a new request: every field checked, before any work is done.

Returns the prompt as token ids, the sampling parameters with `max_new_tokens` resolved
against the server default and the target's context window, and the requested γ (None =
the adaptive policy). Every refusal is INVALID_ARGUMENT naming the field; sizes are checked
before anything is converted or tokenised, and tokenising runs off the event loop.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from coordinator.settings import CoordinatorSettings
from specdec.core.params import SamplingParams
from specdec.errors import InvalidArgument
from specdec.serving.wire import (
    check_session_id,
    check_tokens,
    check_top_logprobs,
    sampling_from_proto,
)

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Admission:
    prompt: list[int]
    params: SamplingParams
    gamma: int | None  # None = the adaptive policy chooses each round
    top_logprobs: int | None = None  # None = no log-probabilities; else alternatives per token


def _check_sizes(request, s: CoordinatorSettings) -> None:
    """Counts and lengths, before anything is converted or tokenised."""
    if request.session_id:
        check_session_id(request.session_id)
    check_top_logprobs(request.top_logprobs)
    if request.top_logprobs and not request.return_logprobs:
        raise InvalidArgument("top_logprobs needs return_logprobs")
    given = [
        name
        for name, value in (
            ("prompt", request.prompt),
            ("prompt_token_ids", request.prompt_token_ids),
            ("messages", request.messages),
        )
        if value
    ]
    if len(given) > 1:
        raise InvalidArgument(f"{' and '.join(given)} are exclusive; set one")
    if len(request.messages) > s.max_messages:
        raise InvalidArgument(
            f"messages: {len(request.messages)} messages exceed --max-messages {s.max_messages}"
        )
    for i, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                f"{message.role[:32]!r}"
            )
    if len(request.prompt_token_ids) > s.max_prompt_tokens:
        raise InvalidArgument(
            f"prompt_token_ids: {len(request.prompt_token_ids)} tokens exceed "
            f"--max-prompt-tokens {s.max_prompt_tokens}"
        )
    size = len(request.prompt.encode("utf-8", "surrogatepass"))
    if size > s.max_prompt_bytes:
        raise InvalidArgument(
            f"prompt: {size} bytes exceed --max-prompt-bytes {s.max_prompt_bytes}"
        )
    size = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in request.messages)
    if size > s.max_prompt_bytes:
        raise InvalidArgument(
            f"messages: {size} bytes of content exceed --max-prompt-bytes {s.max_prompt_bytes}"
        )
    stop, stop_ids = request.sampling.stop, request.sampling.stop_token_ids
    if len(stop) > s.max_stop_sequences:
        raise InvalidArgument(
            f"sampling.stop: {len(stop)} strings exceed --max-stop-sequences {s.max_stop_sequences}"
        )
    for i, text in enumerate(stop):
        if not 1 <= len(text) <= s.max_stop_length:
            raise InvalidArgument(
                f"sampling.stop[{i}] must have 1 to {s.max_stop_length} characters, got {len(text)}"
            )
    if len(stop_ids) > s.max_stop_token_ids:
        raise InvalidArgument(
            f"sampling.stop_token_ids: {len(stop_ids)} ids exceed "
            f"--max-stop-token-ids {s.max_stop_token_ids}"
        )


class Encoder:
    """Prompt tokenising off the event loop. A Rust tokenizer must not be used from two
    threads at once (encoding mutates its padding/truncation state: "Already borrowed"),
    so prompts are encoded by a copy of it, in one thread of their own, while the loop keeps
    the original for detokenising."""

    def __init__(self, tokenizer):
        self.tokenizer = copy.deepcopy(tokenizer)
        self.vocab_size = len(tokenizer)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def encode(self, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.thread, lambda: self.tokenizer.encode(text, add_special_tokens=False)
        )

    async def encode_chat(self, messages: list[dict]) -> list[int]:
        """The conversation rendered with the tokenizer's chat template, as the prompt of the
        assistant's next turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgument("messages: the target model has no chat template; send prompt")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.thread, lambda: self._render(messages))

    def _render(self, messages: list[dict]) -> list[int]:
        from jinja2.exceptions import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except TemplateError as exc:  # the model's own template refused the conversation
            raise InvalidArgument(
                f"messages: the chat template refused them: {str(exc)[:200]}"
            ) from None
        return self.tokenizer.encode(text, add_special_tokens=False)


async def admit(
    request, settings: CoordinatorSettings, encoder: Encoder, max_context: int
) -> Admission:
    """Validate a GenerateRequest for a new session (see the module docstring)."""
    s = settings
    _check_sizes(request, s)
    vocab_size = encoder.vocab_size
    params = sampling_from_proto(request.sampling)
    check_tokens(params.stop_token_ids, vocab_size, "sampling.stop_token_ids")
    if request.prompt_token_ids:
        prompt = check_tokens(request.prompt_token_ids, vocab_size, "prompt_token_ids")
    elif request.prompt:
        prompt = await encoder.encode(request.prompt)
    elif request.messages:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        prompt = await encoder.encode_chat(messages)
    else:
        raise InvalidArgument(
            "prompt: one of prompt, prompt_token_ids or messages must be non-empty"
        )
    if not prompt:
        raise InvalidArgument("prompt: encodes to zero tokens")
    if len(prompt) > s.max_prompt_tokens:
        raise InvalidArgument(
            f"prompt: {len(prompt)} tokens exceed --max-prompt-tokens {s.max_prompt_tokens}"
        )
    if params.max_new_tokens > s.max_new_tokens:
        raise InvalidArgument(
            f"sampling.max_new_tokens {params.max_new_tokens} exceeds the limit {s.max_new_tokens}"
        )
    if len(prompt) >= max_context:
        raise InvalidArgument(
            f"prompt: {len(prompt)} tokens leave no room in the target context {max_context}"
        )
    if params.max_new_tokens and len(prompt) + params.max_new_tokens > max_context:
        raise InvalidArgument(
            f"sampling.max_new_tokens: {len(prompt)} prompt tokens + {params.max_new_tokens} "
            f"new tokens exceed the target context of {max_context} tokens"
        )
    # left unset: the server default, as far as the context allows
    max_new = params.max_new_tokens or min(s.default_max_new_tokens, max_context - len(prompt))
    spec = request.speculation
    gamma = spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else None
    if gamma is not None and gamma > s.max_speculative_tokens:
        raise InvalidArgument(
            f"speculation.num_speculative_tokens {gamma} exceeds --max-speculative-tokens {s.max_speculative_tokens}"
        )
    top = request.top_logprobs if request.return_logprobs else None
    return Admission(prompt, replace(params, max_new_tokens=max_new), gamma, top)
