"""Hostile input, fuzzed, against a live stack (real processes, tiny models): every answer is
OK or a client error naming the field, no process dies, a session under attack keeps its
output. `specdec bench fuzz --examples 10000` is the long run of the same properties."""

from __future__ import annotations

import os

import pytest

from bench.fuzz import Fuzzer
from specdec.launcher.stack import Stack, StackSettings

EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "1000"))  # ≈ 1,700 calls in all


@pytest.mark.slow
def test_fuzzed_requests_get_client_errors_only(model_dirs):
    settings = StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=0,
        coordinator_args=["--default-max-new-tokens", "6"],
    )
    with Stack(settings) as stack:
        fuzzer = Fuzzer(stack.address, stack.draft_addresses[0], stack.target_addresses[0])
        try:
            summary = fuzzer.run(EXAMPLES)
        finally:
            fuzzer.close()
        assert stack.dead_children() == []
    assert summary["examples"] >= EXAMPLES
    codes = fuzzer.codes
    # the fuzz reached past validation too: some calls were served, some refused
    assert any(k.endswith(" OK") and k.startswith("public Generate") for k in codes), codes
    assert any(k.endswith("INVALID_ARGUMENT") and k.startswith("raw") for k in codes), codes
    assert any(k.endswith(" OK") and k.startswith("worker") for k in codes), codes
