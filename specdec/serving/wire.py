"""Conversions between the wire messages (specdec.v1) and the project's value types.

The one place where sampling parameters cross between proto, `SamplingParams` and the form
stored in Redis, where token ids from the wire are checked against the vocabulary, and where
stream chunks fold into a whole response.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from specdec.core.params import SamplingParams
from specdec.errors import InvalidArgument
from specdec.v1 import common_pb2, coordinator_pb2


def sampling_from_proto(msg: common_pb2.SamplingParams, prefix: str = "sampling") -> SamplingParams:
    """Validated SamplingParams from the wire (InvalidArgument naming the field)."""
    if not 0.0 <= msg.top_p <= 1.0:  # also refuses NaN, which the mapping below sends to 1
        raise InvalidArgument(f"{prefix}.top_p must be in [0, 1], got {msg.top_p}")
    params = SamplingParams(
        temperature=float(msg.temperature),
        top_k=int(msg.top_k),
        top_p=float(msg.top_p) if 0.0 < msg.top_p < 1.0 else 1.0,
        min_p=float(msg.min_p),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        max_new_tokens=int(msg.max_new_tokens),
        stop=tuple(msg.stop),
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        ignore_eos=bool(msg.ignore_eos),
    )
    params.validate(prefix)
    return params


def processors_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """What a worker needs to shape p and q̃: the processors only."""
    return common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every field, as a client sent it (the seed included when there is one)."""
    msg = processors_to_proto(params)
    if params.seed is not None:
        msg.seed = params.seed
    msg.max_new_tokens = params.max_new_tokens
    msg.stop.extend(params.stop)
    msg.stop_token_ids.extend(params.stop_token_ids)
    msg.ignore_eos = params.ignore_eos
    return msg


SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def check_session_id(value: str, field_name: str = "session_id") -> str:
    """InvalidArgument unless 1–128 characters of [A-Za-z0-9._:-] (the value is not echoed)."""
    if not SESSION_ID.fullmatch(value):
        raise InvalidArgument(
            f"{field_name} must be 1 to 128 characters of [A-Za-z0-9._:-] (got {len(value)} characters)"
        )
    return value


def validate_sparse(ids: list[int], weights: list[int], vocab: int, field: str) -> None:
    """Raise InvalidArgument naming the field when a wire q̃ is not a valid distribution."""
    if not ids:
        raise InvalidArgument(f"{field}.token_ids must not be empty")
    if len(ids) != len(weights):
        raise InvalidArgument(
            f"{field}: token_ids and weights differ in length ({len(ids)} vs {len(weights)})"
        )
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"{field}.token_ids must not repeat a token")
    if max(ids) >= vocab:
        raise InvalidArgument(f"{field}.token_ids: {max(ids)} is outside the vocabulary ({vocab})")
    if sum(weights) <= 0:
        raise InvalidArgument(f"{field}.weights must have a positive sum")


MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's API allows


def check_top_logprobs(value: int) -> int:
    if value > MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs: {value} exceeds the limit of {MAX_TOP_LOGPROBS}")
    return value


def check_draft_dists(
    candidates: list[int], dists, vocab: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Raise InvalidArgument naming the field unless `dists` holds one valid q̃ per candidate
    (or none: token-only) and each gives its candidate a positive weight; else each q̃'s token
    ids and weights as lists (read off the message once: ~2.4 µs a 64-entry field)."""
    if dists and len(dists) != len(candidates):
        raise InvalidArgument(
            f"draft_dists: expected {len(candidates)} (one per candidate) or none, got {len(dists)}"
        )
    all_ids, all_weights = [], []
    for i, dist in enumerate(dists):
        ids, weights = list(dist.token_ids), list(dist.weights)
        validate_sparse(ids, weights, vocab, f"draft_dists[{i}]")
        # ids do not repeat (checked): the candidate's weight is at its one index
        if candidates[i] not in ids or weights[ids.index(candidates[i])] <= 0:
            raise InvalidArgument(f"draft_dists[{i}] gives candidate_ids[{i}] zero probability")
        all_ids.append(ids)
        all_weights.append(weights)
    return all_ids, all_weights


def check_tokens(tokens: Iterable[int], vocab_size: int, field_name: str) -> list[int]:
    """Token ids as ints; InvalidArgument naming the first one outside the vocabulary."""
    tokens = [int(t) for t in tokens]
    for i, token in enumerate(tokens):
        if token >= vocab_size:
            raise InvalidArgument(
                f"{field_name}[{i}] = {token} is outside the vocabulary ({vocab_size})"
            )
    return tokens


def stats_to_proto(stats: dict | None) -> coordinator_pb2.GenerationStats:
    """GenerationStats from the stats dict stored with a session (unknown keys ignored)."""
    fields = coordinator_pb2.GenerationStats.DESCRIPTOR.fields_by_name
    return coordinator_pb2.GenerationStats(
        **{k: v for k, v in (stats or {}).items() if k in fields}
    )


def merge_chunk(response: coordinator_pb2.GenerateResponse, chunk) -> None:
    """Fold one GenerateChunk into a GenerateResponse."""
    response.session_id = chunk.session_id
    response.token_ids.extend(chunk.token_ids)
    response.text += chunk.text
    response.logprobs.extend(chunk.logprobs)
    response.top_logprobs.extend(chunk.top_logprobs)
    if chunk.finish_reason:
        response.finish_reason = chunk.finish_reason
        response.stats.CopyFrom(chunk.stats)


def merge(chunks) -> coordinator_pb2.GenerateResponse:
    """The whole response of a stream of chunks."""
    response = coordinator_pb2.GenerateResponse()
    for chunk in chunks:
        merge_chunk(response, chunk)
    return response
