"""bench.process_ab loads another revision's processing next to this checkout's and reports
whether the two agree."""

from __future__ import annotations

import torch

from bench import process_ab
from specdec.core.params import SamplingParams


def test_a_revision_module_processes_rows_as_its_source_says(tmp_path):
    module = process_ab.revision_module("HEAD", str(tmp_path))
    assert module.__name__ == "baseline_processed"
    logits = process_ab.rows_of("flat", 2048)
    mine = process_ab.current.process(
        logits, process_ab.current.ProcessorParams.of([process_ab.PARAMS] * len(logits))
    )
    theirs = module.process(logits, module.ProcessorParams.of([process_ab.PARAMS] * len(logits)))
    assert torch.equal(mine.tau, theirs.tau)  # HEAD is this code: the same cut
    # negative control: other params give another cut, which the comparison would report
    other = module.process(
        logits, module.ProcessorParams.of([SamplingParams(temperature=0.8, top_p=0.5)] * 16)
    )
    assert not torch.equal(mine.tau, other.tau)


def test_the_table_flags_a_disagreement():
    row = {
        "vocab": 8192,
        "rows": "flat",
        "past_window": 16,
        "baseline_ms": 4.0,
        "this_ms": 2.0,
        "ratio": 0.5,
        "tau_equal": True,
        "max_log_z_difference": 1e-8,
    }
    assert "| 8,192 | flat | 16 | 4.00 | 2.00 | 0.50× | yes |" in process_ab.markdown([row], "X", 1)
    assert "| NO |" in process_ab.markdown([{**row, "tau_equal": False}], "X", 1)
