"""The measured rule for when a ``Linear`` gathers over its input's non-zeros (CPU).

`spikeckpt.adapters.affine.sparse_share`: the largest share of non-zero inputs at which a
gather beats the dense product, by the outputs each torch thread computes (the dense
product's speed grows with the threads, the listing of the non-zeros' does not; measured by
``benchmarks/bench_gather.py``). A chunk's forward pass and its recomputation must take the
same path (a gather sums in another order): the forward pass's thread count is kept for the
recomputation. These tests run with the library's rule (``measured_gather_rule``), not the
pinned one of the other tests (``conftest.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import snntorch as snn
import torch
from snn_loops import gather_calls, leaky_loop
from torch import nn

import spikeckpt as sc
from spikeckpt.adapters import affine

pytestmark = pytest.mark.measured_gather_rule


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_share_follows_the_outputs_per_thread() -> None:
    share = affine.sparse_share
    for (out, want), threads in zip(affine.BREAK_EVEN, (1, 2, 4, 8, 16), strict=False):
        assert share(out * threads, threads) == pytest.approx(want)
    assert share(64, 1) == share(128, 2) == share(10, 1) == 0.0  # narrow: never
    assert 0 < share(90, 1) < share(128, 1) < share(200, 1) < share(400, 1) < share(4096, 1)
    assert share(4096, 1) == share(10**6, 1) == affine.BREAK_EVEN[-1][1]
    assert share(1000, 1) > share(1000, 2) > share(1000, 8) > share(1000, 16) == 0.0


def _tutorial_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(100, 300), snn.Leaky(beta=0.9, threshold=0.3),
        nn.Linear(300, 10), snn.Leaky(beta=0.9),
    )  # fmt: skip


def test_a_chunk_is_recomputed_on_the_path_of_its_forward_pass(
    one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Input 4% spikes into ``Linear(100, 300)``: on one thread the rule gathers (share
    0.065), on 16 it does not. Threads changed between the forward pass and the backward: the
    recomputation still gathers, as its forward pass did (it multiplied densely: a sum in
    another order, which can flip a spike near the threshold), and the gradients are the
    plain loop's."""
    seen = gather_calls(monkeypatch)
    net = _tutorial_net()
    x = (torch.rand(12, 4, 100) < 0.04).float()
    params = list(net.parameters())
    want = torch.autograd.grad(leaky_loop(net, x)[0].sum(), params)
    seq = sc.wrap(net, granularity="layer", chunk=4)
    out = seq(x)
    assert seq.last_stats.blocks[0].neuron == "fused"
    forward = seen.count((300, 100))
    assert forward == 3  # every chunk gathered
    torch.set_num_threads(16)
    got = torch.autograd.grad(out.sum(), params)
    assert seen.count((300, 100)) == 2 * forward  # and every recomputed chunk
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_narrow_outputs_per_thread_multiply_densely(
    one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Linear(100, 64)``: a gather loses to the dense product at every density measured
    (0.91x at 3% on one thread, 0.50x on two), so it never gathers; the pinned rule of the
    other tests gathered there."""
    seen = gather_calls(monkeypatch)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(100, 64), snn.Leaky(beta=0.9))
    x = (torch.rand(12, 4, 100) < 0.03).float()
    sc.wrap(net, granularity="layer", chunk=4)(x).sum().backward()
    assert seen == []
    monkeypatch.setattr(affine, "BREAK_EVEN", ((0, 1 / 16),))
    sc.wrap(net, granularity="layer", chunk=4)(x).sum().backward()
    assert seen.count((64, 100)) == 6  # the check can fail: the same run gathers there
