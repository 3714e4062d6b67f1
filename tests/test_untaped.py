"""The untaped layer-wise backward (`spikeckpt.engine.direct`): a block whose synapse is one
plain ``nn.Linear`` into a fused neuron is recomputed and backpropagated without autograd.

Checked against the taped path (the same run with ``DIRECT_BACKWARD`` off) and against the
framework's plain per-step loop: spikes bitwise, gradients (input, weights, biases, learnable
neuron parameters, initial states) at float32 round-off, on random models, chunk lengths,
inputs (dense with and without a gradient, packed), biases and outputs; its pieces (the
synapse with room for the state before, the membranes kept over the synaptic input, the
surrogate's gradient over the membranes) bitwise the pieces they replace; and its peak below
the taped path's.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import snntorch as snn
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snn_loops import gather_calls
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.engine import layerwise_job
from spikeckpt.engine.inputs import sparse_chunk_of
from spikeckpt.storage.spiketrain import SpikeTrain

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as norse

NEURONS = {
    "leaky": lambda n: snn.Leaky(beta=0.9),
    "leaky zero": lambda n: snn.Leaky(beta=0.8, reset_mechanism="zero"),
    "leaky none": lambda n: snn.Leaky(beta=0.95, reset_mechanism="none"),
    "leaky learnable": lambda n: snn.Leaky(
        beta=torch.rand(n), learn_beta=True, threshold=0.8, learn_threshold=True
    ),
    "leaky fast_sigmoid": lambda n: snn.Leaky(
        beta=0.9, spike_grad=snn.surrogate.fast_sigmoid(slope=5)
    ),
    "synaptic": lambda n: snn.Synaptic(alpha=0.8, beta=0.9),
    "lapicque": lambda n: snn.Lapicque(beta=0.9),
    "norse lif": lambda n: norse.LIFCell(),
    "rleaky": lambda n: snn.RLeaky(beta=0.9, linear_features=n, learn_beta=True),
    "rsynaptic": lambda n: snn.RSynaptic(alpha=0.8, beta=0.9, all_to_all=False, V=0.7),
}


def _net(kinds: list[str], widths: list[int], bias: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for kind, (a, b) in zip(kinds, zip(widths, widths[1:], strict=False), strict=True):
        linear = nn.Linear(a, b, bias=bias)
        with torch.no_grad():
            linear.weight.mul_(4.0)  # spikes in every layer
        layers += [linear, NEURONS[kind](b)]
    return nn.Sequential(*layers)


def _plain_loop(net: nn.Sequential, x: Tensor) -> Tensor:
    """The framework's per-step loop, as its users write it; output spikes ``(T, B, n)``."""
    states: list[Any] = [None] * (len(net) // 2)
    out = []
    for x_t in x.unbind(0):
        h = x_t
        for i in range(0, len(net), 2):
            z, neuron = net[i](h), net[i + 1]
            j = i // 2
            if isinstance(neuron, norse.LIFCell):
                h, states[j] = neuron(z, states[j])
            elif isinstance(neuron, snn.Synaptic):
                syn, mem = states[j] or (torch.zeros_like(z), torch.zeros_like(z))
                h, syn, mem = neuron(z, syn, mem)
                states[j] = (syn, mem)
            elif isinstance(neuron, snn.RSynaptic):
                zeros = (torch.zeros_like(z),) * 3
                h, syn, mem = neuron(z, *(states[j] or zeros))
                states[j] = (h, syn, mem)
            elif isinstance(neuron, snn.RLeaky):
                spk, mem = states[j] or (torch.zeros_like(z), torch.zeros_like(z))
                h, mem = neuron(z, spk, mem)
                states[j] = (h, mem)
            else:
                h, states[j] = neuron(z, states[j] if states[j] is not None else z * 0)
        out.append(h)
    return torch.stack(out)


def _run(net: nn.Sequential, x: Any, chunk: int, untaped: bool) -> Any:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layerwise_job, "DIRECT_BACKWARD", untaped)
        seq = sc.wrap(net, granularity="layer", chunk=chunk)
        return seq, seq(x)


def _grads(out: Tensor, wrt: list[Tensor]) -> list[Tensor | None]:
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    return list(torch.autograd.grad((out * weights).sum(), wrt, allow_unused=True))


def _close(a: Tensor | None, b: Tensor | None, what: str) -> None:
    if a is None or b is None:
        assert all(g is None or not g.any() for g in (a, b)), what
        return
    scale = float(a.abs().max()) if a.numel() else 0.0
    torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-6 * (1 + scale), msg=what)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(sorted(NEURONS)), min_size=1, max_size=3),
    T=st.integers(1, 19),
    chunk=st.integers(1, 8),
    batch=st.integers(1, 3),
    form=st.sampled_from(["dense", "dense with grad", "packed"]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_untaped_blocks_match_the_taped_path_and_the_plain_loop(
    kinds: list[str],
    T: int,
    chunk: int,
    batch: int,
    form: str,
    bias: bool,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    widths = [40, *torch.randint(2, 7, (len(kinds),)).tolist()]
    net = _net(kinds, widths, bias)
    dense = (torch.rand(T, batch, widths[0]) < 0.04).float()  # sparse: the gather runs
    x: Any = dense
    if form == "dense with grad":
        x = dense.clone().requires_grad_()
    elif form == "packed":
        x = SpikeTrain.from_dense(dense)
    params = [p for p in net.parameters() if p.requires_grad]
    wrt = params + ([x] if form == "dense with grad" else [])

    plain = _plain_loop(net, x if form == "dense with grad" else dense)
    want = _grads(plain, wrt)
    results = {}
    for untaped in (True, False):
        seq, out = _run(net, x, chunk, untaped)
        results[untaped] = (out.detach(), _grads(out, wrt))
        ran = [b.untaped_chunks for b in seq.last_stats.blocks]
        n_chunks = -(-T // min(chunk, T))
        assert ran == ([n_chunks] * len(kinds) if untaped else [0] * len(kinds)), ran
    for untaped, (out, got) in results.items():
        assert torch.equal(out, plain.detach()), (kinds, untaped)
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            _close(a, b, f"{kinds} untaped={untaped}: gradient {i}")


def test_the_synapse_with_room_gives_the_blocks_own_values() -> None:
    """``affine.forward(x, sparse, lead=1)``'s rows 1.. are bitwise the block's synapse (dense,
    and its sparse synapse over a dense chunk and over a packed train's positions)."""
    torch.manual_seed(0)
    for bias in (True, False):
        net = _net(["leaky"], [300, 64], bias)
        seq = sc.wrap(net, granularity="layer", chunk=5)
        (block,) = seq.layer_blocks(True)
        assert block.affine is not None and block.sparse_synapse is not None
        dense = (torch.rand(7, 3, 300) < 0.03).float()
        packed = sparse_chunk_of(SpikeTrain.from_dense(dense), 0, 7, torch.device("cpu"))
        with torch.no_grad():
            for x, sparse, want in (
                (dense, False, block.synapse(dense)),
                (dense, True, block.sparse_synapse(dense)),
                (packed, True, block.sparse_synapse(packed)),
            ):
                for lead in (0, 1):
                    made = block.affine.forward(x, sparse, lead=lead)
                    assert made is not None
                    assert made[0].shape == (7 + lead, 3, 64)
                    assert torch.equal(made[0][lead:], want), (bias, sparse, lead)
        block.cleanup()


@pytest.mark.parametrize("reset", ["subtract", "zero", "none"])
@pytest.mark.parametrize("width", [64, 9000])  # the NumPy loop and the torch loop
def test_membranes_over_the_input_and_gradient_over_the_membranes_are_bitwise(
    reset: str, width: int
) -> None:
    """A Leaky kernel keeping its membranes over the synaptic input (``into``) and writing
    the surrogate's gradient over them (``consume``) gives bitwise what it gives with buffers
    of its own."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(8, width), snn.Leaky(beta=0.9, reset_mechanism=reset))
    seq = sc.wrap(net, granularity="layer", chunk=6)
    (block,) = seq.layer_blocks(True)
    kernel = block.fused
    assert kernel is not None
    k, batch = 6, 2
    z = torch.randn(k, batch, width) * 2
    mem0 = torch.randn(batch, width)
    assert kernel.accepts([mem0], z)
    g_y = torch.randn(k, batch, width)
    g_final = [torch.randn(batch, width)]
    own = kernel.forward([mem0], z.clone(), True, False)
    room = torch.empty(k + 1, batch, width)
    room[1:] = z
    kept = kernel.forward([mem0], room[1:], True, False, want_y=False, into=room)
    assert kept[1] is None and kept[3][0] is room  # no spikes made, membranes over the input
    assert torch.equal(kept[0][0], own[0][0])
    for a, b in zip(own[3], kept[3], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    plain = kernel.backward(own[3], g_y, g_final, None, True, [])
    consumed = kernel.backward(kept[3], g_y, g_final, None, True, [], consume=True)
    assert torch.equal(plain[0], consumed[0]) and torch.equal(plain[1][0], consumed[1][0])


def test_an_untaped_step_holds_less_than_a_taped_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The taped path holds the recomputed chunk's synaptic input, its float spikes and the
    surrogate's gradient beside the membranes; the untaped one keeps the membranes over the
    input and the gradient over the membranes (measured on 100-256-10 at batch 16, chunk 16,
    packed input at 5%: 1.10 MiB against 1.55 MiB)."""
    torch.manual_seed(0)
    net = _net(["leaky", "leaky"], [100, 256, 10], True)
    x = SpikeTrain.from_dense((torch.rand(64, 16, 100) < 0.05).float())
    peaks = {}
    for untaped in (True, False):
        monkeypatch.setattr(layerwise_job, "DIRECT_BACKWARD", untaped)
        seq = sc.wrap(net, granularity="layer", chunk=16, storage="host")
        net.zero_grad(set_to_none=True)
        with sc.MemoryMeter() as meter:
            seq(x).sum().backward()
        peaks[untaped] = meter.peak_bytes
    assert peaks[True] < 0.8 * peaks[False], peaks


def test_a_later_block_gathers_over_its_input_spikes_in_both_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A block after the first whose backward runs untaped reads its input spikes as positions
    in the forward pass and in the recomputation alike (its input gradient is ``dL/dz @ W``):
    outputs bitwise the plain loop's, gradients at round-off; with the untaped path off it
    multiplies densely, as it does a block of fewer than `GATHER_MIN_OUTPUTS` outputs."""
    net = _gathering_net()
    dense = (torch.rand(24, 4, 50) < 0.1).float()
    plain = _plain_loop(net, dense)
    assert float(plain.detach().mean()) > 0
    assert 0 < float(_hidden_rate(net, dense)) < 1 / 16
    params = list(net.parameters())
    want = _grads(plain, params)
    seen = gather_calls(monkeypatch)
    for untaped in (True, False):
        seen.clear()
        seq, out = _run(net, dense, 6, untaped)
        got = _grads(out, params)
        assert torch.equal(out.detach(), plain.detach())
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            _close(a, b, f"untaped={untaped}: gradient {i}")
        later = seen.count((80, 400))
        # 4 chunks: forward and recomputation gather, or neither
        assert later == (8 if untaped else 0), (untaped, seen)
    narrow = nn.Sequential(net[0], net[1], nn.Linear(400, 10), snn.Leaky(beta=0.9))
    seen.clear()
    _run(narrow, dense, 6, True)[1].sum().backward()
    assert seen.count((10, 400)) == 0, seen


def _gathering_net() -> nn.Sequential:
    """50 -> 400 -> 80: the hidden layer fires below `SPARSE_DENSITY`, so the second block
    gathers over it."""
    torch.manual_seed(3)
    net = nn.Sequential(
        nn.Linear(50, 400), snn.Leaky(beta=0.9), nn.Linear(400, 80), snn.Leaky(beta=0.9)
    )
    with torch.no_grad():
        net[0].weight.mul_(2.0)
        net[2].weight.mul_(4.0)
    return net


def _hidden_rate(net: nn.Sequential, x: Tensor) -> Tensor:
    with torch.no_grad():
        return _plain_loop(net[:2], x).mean()


def test_a_hook_added_between_forward_and_backward_of_a_gathering_block_is_refused() -> None:
    net = _gathering_net()
    out = sc.wrap(net, granularity="layer", chunk=6)((torch.rand(24, 4, 50) < 0.1).float())
    handle = net[2].register_forward_hook(lambda module, args, result: None)
    try:
        with pytest.raises(sc.UsageError, match=r"block '3' gathered .* run the forward again"):
            out.sum().backward()
    finally:
        handle.remove()


def test_a_wide_block_whose_neuron_runs_per_step_is_taped_and_multiplies_densely() -> None:
    """A later block may gather only where its fused neuron takes the chunk: Norse's cell on
    float64 runs per step (its parameters stay float32), so the block is taped, multiplies
    densely and matches the plain loop (it was refused once, having gathered in the forward
    pass)."""
    torch.manual_seed(3)
    net = nn.Sequential(
        nn.Linear(50, 400), norse.LIFCell(), nn.Linear(400, 80), norse.LIFCell()
    ).double()
    with torch.no_grad():
        net[0].weight.mul_(8.0)
        net[2].weight.mul_(8.0)
    x = (torch.rand(30, 4, 50) < 0.1).double()
    plain = _plain_loop(net, x)
    params = list(net.parameters())
    want = _grads(plain, params)
    seq, out = _run(net, x, 6, True)
    assert [b.neuron for b in seq.last_stats.blocks] == ["per-step", "per-step"]
    assert torch.equal(out.detach(), plain.detach()) and float(plain.detach().mean()) > 0
    for i, (a, b) in enumerate(zip(want, _grads(out, params), strict=True)):
        _close(a, b, f"gradient {i}")


def test_a_block_that_declines_untaped_gets_its_output_gradients_back_in_place() -> None:
    """``output="both"`` with a loss on the membranes only (no spike gradient): a hook added
    after the forward pass makes the first block decline the untaped path; the taped path gets
    both output gradients back in their places (a None for the spikes) and the gradients
    agree with a run without the hook."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), snn.Leaky(beta=0.9))
    x = (torch.rand(8, 2, 6) < 0.5).float()
    got = []
    for hook in (False, True):
        seq = sc.wrap(net, granularity="layer", chunk=4, output="both")
        _, mem = seq(x)
        handle = net[0].register_forward_hook(lambda m, a, r: None) if hook else None
        got.append(torch.autograd.grad(mem.sum(), list(net.parameters())))
        if handle is not None:
            handle.remove()
        assert seq.last_stats.blocks[0].untaped_chunks == (0 if hook else 2)
    for a, b in zip(*got, strict=True):
        _close(a, b, "hooked against untaped")
