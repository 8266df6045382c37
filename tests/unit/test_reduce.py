"""first_argmax is torch.argmax, index for index, at every vocabulary shape and on ties — by
torch's chunked ops and by the compiled sampling kernel's scan (`specdec.core.row_kernel`)."""

from __future__ import annotations

import pytest
import torch

from specdec.core import row_kernel
from specdec.core.reduce import CHUNK, chunked, first_argmax


@pytest.fixture(autouse=True, params=["compiled", "torch"])
def sampling_kernel(request, monkeypatch):
    module = None
    if request.param == "compiled":
        module = row_kernel.EXTENSION.get()
        assert not isinstance(module, str), module
    monkeypatch.setattr(row_kernel, "_chosen", [module])
    return module


def test_a_row_holding_nan_takes_its_first_nan_as_torch_does():
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1))
    x[0, [17, 4000]] = float("nan")
    x[1, 0] = float("nan")
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [7, 4 * CHUNK, 8192, 49_152, 128_256, 4 * CHUNK + 1])
def test_equals_torch_argmax(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, 5, vocab, generator=g)
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))
    assert torch.equal(first_argmax(x[:, 0]), x[:, 0].argmax(dim=-1))


def test_ties_take_the_first_maximum_across_and_inside_chunks():
    vocab = 10 * CHUNK + 37
    x = torch.zeros(5, vocab)
    x[0, [3 * CHUNK + 5, 3 * CHUNK + 9, 7 * CHUNK]] = 2.0  # ties in one chunk and in another
    x[1, [vocab - 1, vocab - 30]] = 1.0  # ties in the shorter last chunk
    x[2] = float("-inf")  # everything masked: index 0, as torch.argmax
    x[3, vocab - 1] = 5.0  # the very last value
    x[4] = torch.randint(0, 2, (vocab,), generator=torch.Generator().manual_seed(0)).float()
    expected = x.argmax(dim=-1)
    assert expected.tolist()[:4] == [3 * CHUNK + 5, vocab - 30, 0, vocab - 1]
    assert torch.equal(first_argmax(x), expected)
    # negative control: the last of equal maxima is a different answer on these rows
    last = vocab - 1 - x.flip(-1).argmax(dim=-1)
    assert not torch.equal(first_argmax(x), last)


def test_the_chunked_reduction_covers_a_shorter_last_chunk():
    x = torch.arange(2 * 1000 + 3, dtype=torch.float32).reshape(1, -1)
    sums = chunked(x, torch.sum, 1000)
    assert sums.shape == (1, 3)
    assert sums.sum().item() == x.sum().item()
    assert chunked(x, torch.amax, 1000).tolist() == [[999.0, 1999.0, 2002.0]]
