"""A draft whose LM head covers only some tokens (FR-Spec): its logits are the full head's
rows for those tokens, its proposals name real token ids with the same q̃ weights, and a
target refuses such a model."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from draft_worker.engine import ModelProposer, ProposeItem
from specdec.core.params import SamplingParams
from specdec.engine.kv import KVSession
from specdec.engine.model import HEAD_FILE, ModelRuntime, RuntimeSettings
from target_worker.engine import TargetEngine

HEAD = [7, 3, 250, 11, 42, 99, 5, 120, 64, 200, 1, 30, 31, 32, 33, 34]  # not sorted on purpose


def with_head(src: str, dst, ids) -> str:
    shutil.copytree(src, dst)
    save_file({"token_ids": torch.tensor(ids, dtype=torch.int64)}, str(dst / HEAD_FILE))
    return str(dst)


@pytest.fixture(scope="module")
def pair(model_dirs, tmp_path_factory):
    full = ModelRuntime(RuntimeSettings(model_dirs["draft"], device="cpu"))
    restricted_dir = with_head(model_dirs["draft"], tmp_path_factory.mktemp("h") / "d", HEAD)
    return full, ModelRuntime(RuntimeSettings(restricted_dir, device="cpu"))


def run(runtime, history):
    session = KVSession("s")
    session.sync(history)
    return runtime.forward([session], [session.pending()], keep=1)[0, -1]


def test_logits_are_the_full_heads_rows(pair):
    full, restricted = pair
    history = full.tokenizer.encode("def add(a, b):\n    return")
    assert restricted.vocab_size == full.vocab_size  # the vocabulary stays the model's
    assert restricted.head_ids.tolist() == HEAD
    got, want = run(restricted, history), run(full, history)[torch.tensor(HEAD)]
    assert got.shape == (len(HEAD),)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # negative control: the rows in another order do not match
    assert not torch.allclose(got, run(full, history)[torch.tensor(sorted(HEAD))], atol=1e-5)


def propose(runtime, history, params):
    session = KVSession("s")
    session.sync(history)
    item = ProposeItem(session, len(history), 3, params, seed=5, token_only=params.greedy)
    return ModelProposer(runtime, wire_top_k=8).process([item])[0]


def test_proposals_name_token_ids_inside_the_head(pair):
    full, restricted = pair
    history = full.tokenizer.encode("import os\n")
    greedy = propose(restricted, history, SamplingParams(temperature=0.0))
    assert set(greedy.candidates) <= set(HEAD)
    first = run(full, history)[torch.tensor(HEAD)].argmax()
    assert greedy.candidates[0] == HEAD[int(first)]
    sampled = propose(restricted, history, SamplingParams(temperature=1.0, seed=5))
    assert set(sampled.candidates) <= set(HEAD)
    for step, (ids, weights) in enumerate(zip(sampled.dist_ids, sampled.dist_weights)):
        assert set(ids) <= set(HEAD) and len(ids) == len(weights) and min(weights) > 0
        assert sampled.candidates[step] in ids  # sampled from the q̃ it sends


def test_a_target_refuses_a_restricted_head(pair):
    with pytest.raises(ValueError, match="only as a draft"):
        TargetEngine(pair[1])


@pytest.mark.parametrize("ids", [[], [3, 3], [-1, 2], [10**6]])
def test_a_bad_head_file_is_refused(model_dirs, tmp_path, ids):
    d = with_head(model_dirs["draft"], tmp_path / "d", ids)
    with pytest.raises(ValueError, match=HEAD_FILE):
        ModelRuntime(RuntimeSettings(d, device="cpu"))
