"""Admission of a new request: every field checked, before any work is done.

Returns the prompt as token ids, the sampling parameters with `max_new_tokens` resolved
against the server default and the target's context window, and the requested γ (None =
the adaptive policy). Every refusal is INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from coordinator.settings import CoordinatorSettings
from specdec.core.params import SamplingParams
from specdec.errors import InvalidArgument
from specdec.serving.wire import check_tokens, sampling_from_proto

SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(frozen=True)
class Admission:
    prompt: list[int]
    params: SamplingParams
    gamma: int | None  # None = the adaptive policy chooses each round


def admit(request, settings: CoordinatorSettings, tokenizer, max_context: int) -> Admission:
    """Validate a GenerateRequest for a new session (see the module docstring)."""
    s = settings
    vocab_size = len(tokenizer)
    if request.return_logprobs:
        raise InvalidArgument("return_logprobs: log-probabilities are not served yet")
    if request.prompt and request.prompt_token_ids:
        raise InvalidArgument("prompt and prompt_token_ids are exclusive; set one")
    if request.prompt_token_ids:
        prompt = check_tokens(request.prompt_token_ids, vocab_size, "prompt_token_ids")
    elif request.prompt:
        prompt = tokenizer.encode(request.prompt, add_special_tokens=False)
    else:
        raise InvalidArgument("prompt: one of prompt or prompt_token_ids must be non-empty")
    if not prompt:
        raise InvalidArgument("prompt: encodes to zero tokens")
    if len(prompt) > s.max_prompt_tokens:
        raise InvalidArgument(
            f"prompt: {len(prompt)} tokens exceed --max-prompt-tokens {s.max_prompt_tokens}"
        )
    params = sampling_from_proto(request.sampling)
    check_tokens(params.stop_token_ids, vocab_size, "sampling.stop_token_ids")
    if any(not text for text in params.stop):
        raise InvalidArgument("sampling.stop: stop strings must not be empty")
    max_new = params.max_new_tokens or s.default_max_new_tokens
    if max_new > s.max_new_tokens:
        raise InvalidArgument(
            f"sampling.max_new_tokens {max_new} exceeds the limit {s.max_new_tokens}"
        )
    max_new = min(max_new, max_context - len(prompt))
    if max_new < 1:
        raise InvalidArgument(
            f"prompt: {len(prompt)} tokens leave no room in the target context {max_context}"
        )
    spec = request.speculation
    gamma = spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else None
    if gamma is not None and gamma > s.max_speculative_tokens:
        raise InvalidArgument(
            f"speculation.num_speculative_tokens {gamma} exceeds --max-speculative-tokens {s.max_speculative_tokens}"
        )
    if request.session_id and not SESSION_ID.match(request.session_id):
        raise InvalidArgument("session_id must match [A-Za-z0-9._:-]{1,128}")
    return Admission(prompt, replace(params, max_new_tokens=max_new), gamma)
