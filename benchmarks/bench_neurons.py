"""Layer-wise fused neurons against their framework's own loop, one neuron type at a time.

The peers' setup (`bench_peers.py`: one ``Linear(n, n)`` + the neuron, batch 16, T = 500,
input spikes at 5%, loss on the output spikes) with snnTorch's ``Leaky``, ``Synaptic``, ``Alpha`` and
their ``"zero"`` resets, ``Leaky(reset_delay=False)``, ``RLeaky`` (recurrent ``Linear`` and
one-to-one), ``RSynaptic``, and Norse's ``LIFCell``, ``LIFBoxCell``, ``LICell``, ``LSNNCell``,
``LIFExCell``, ``LIFAdExCell``, ``IAFCell``, ``LIBoxCell``, a cell of
``coba_lif_feed_forward_step``, ``IzhikevichCell`` (``tonic_spiking``), ``LIFRefracCell``,
``LIFAdExRefracCell``, ``LIFExRecurrentCell``, ``LIFAdExRecurrentCell``,
``LIFRefracRecurrentCell`` and ``LIFAdExRefracRecurrentCell`` (where Norse is installed); spikeckpt's row is ``wrap(net, granularity="layer", chunk=25)``,
with the recurrence compiled by Numba (`spikeckpt.adapters.jit_loops`) and without it
(``host_loops.USE_JIT = False``: NumPy's or the torch loop, as before Numba).
Time is the minimum of interleaved rounds after a warm-up, in one process; the outputs are
compared (bitwise, else their largest relative difference) and the first weight's gradient
relative to the loop's; peak is `spikeckpt.MemoryMeter`'s (live tensors on the CPU) of one
separate training step of the loop and of the layer-wise row.

    taskset -c 1 python benchmarks/bench_neurons.py --n 512 --threads 1
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import snntorch as snn
import torch
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.adapters import host_loops

try:
    import norse.torch as norse
except ImportError:  # pragma: no cover - norse is an extra
    norse = None

NEURONS: dict[str, Callable[[], nn.Module]] = {
    "Leaky": lambda: snn.Leaky(beta=0.95),
    "Leaky, reset zero": lambda: snn.Leaky(beta=0.95, reset_mechanism="zero"),
    "Leaky, reset_delay=False": lambda: snn.Leaky(beta=0.95, reset_delay=False),
    "Synaptic": lambda: snn.Synaptic(alpha=0.9, beta=0.95),
    "Synaptic, reset zero": lambda: snn.Synaptic(alpha=0.9, beta=0.95, reset_mechanism="zero"),
    "Alpha": lambda: snn.Alpha(alpha=0.95, beta=0.9),
    "Alpha, reset subtract": lambda: snn.Alpha(alpha=0.95, beta=0.9, reset_mechanism="subtract"),
    # recurrent weights inside the neuron: made for the layer's width (`main`)
    "RLeaky": lambda: snn.RLeaky(beta=0.95, linear_features=WIDTH[0]),
    "RLeaky, one-to-one": lambda: snn.RLeaky(beta=0.95, all_to_all=False, V=0.5),
    "RSynaptic": lambda: snn.RSynaptic(alpha=0.9, beta=0.95, linear_features=WIDTH[0]),
}
#: the neurons per layer of the run (``--n``), for the neurons whose weights need it
WIDTH = [512]
if norse is not None:
    NEURONS |= {
        "Norse LIFCell": lambda: norse.LIFCell(),
        "Norse LIFBoxCell": lambda: norse.LIFBoxCell(),
        "Norse LICell": lambda: norse.LICell(),
        "Norse LSNNCell": lambda: norse.LSNNCell(),
        "Norse LIFExCell": lambda: norse.LIFExCell(),
        "Norse LIFAdExCell": lambda: norse.LIFAdExCell(),
        "Norse IAFCell": lambda: norse.IAFCell(),
        "Norse LIBoxCell": lambda: norse.LIBoxCell(),
        "Norse CobaLIF feed-forward": lambda: coba_cell(),
        "Norse IzhikevichCell": lambda: norse.IzhikevichCell(norse.tonic_spiking),
        "Norse LIFRefracCell": lambda: norse.LIFRefracCell(),
        "Norse LIFAdExRefracCell": lambda: norse.LIFAdExRefracCell(),
        # input and recurrent weights inside the cell: made for the layer's width
        "Norse LIFExRecurrentCell": lambda: norse.LIFExRecurrentCell(WIDTH[0], WIDTH[0]),
        "Norse LIFAdExRecurrentCell": lambda: norse.LIFAdExRecurrentCell(WIDTH[0], WIDTH[0]),
        "Norse LIFRefracRecurrentCell": lambda: norse.LIFRefracRecurrentCell(WIDTH[0], WIDTH[0]),
        "Norse LIFAdExRefracRecurrentCell": lambda: norse.LIFAdExRefracRecurrentCell(
            WIDTH[0], WIDTH[0]
        ),
    }


def coba_cell() -> nn.Module:
    """A Norse cell of ``coba_lif_feed_forward_step`` (Norse 1.1.0 has no module of it),
    starting at ``v_rest``; synapses 1000x faster than the default (``tau_syn_*_inv`` 200:
    the default's conductances barely decay at ``dt`` 1 ms, grow until Euler's step is
    unstable). Its gradient overflows over T = 500 even so (Norse's reset passes the spike's
    gradient, times ``v_reset - v_d``, 60 mV near the threshold), in Norse's loop as in the
    kernel: the row's ``max rel dW`` is nan."""
    from norse.torch.functional.coba_lif import (
        CobaLIFFeedForwardState,
        CobaLIFParameters,
        coba_lif_feed_forward_step,
    )
    from norse.torch.module.snn import SNNCell

    p = CobaLIFParameters(tau_syn_exc_inv=torch.tensor(200.0), tau_syn_inh_inv=torch.tensor(200.0))

    def rest(x: Tensor) -> CobaLIFFeedForwardState:
        zeros = torch.zeros_like(x)
        return CobaLIFFeedForwardState(zeros + p.v_rest, zeros, zeros.clone())

    return SNNCell(coba_lif_feed_forward_step, rest, p)


def framework_loop(net: nn.Sequential, x: Tensor) -> Tensor:
    """The framework's own time loop over ``x`` ``(T, B, n)``: the outputs ``(T, B, n)``."""
    linear, neuron = net[0], net[1]
    if not isinstance(neuron, snn.SpikingNeuron):  # Norse: (y, state) = cell(z, state)
        outputs, state = [], None
        for x_t in x:
            y, state = neuron(linear(x_t), state)
            outputs.append(y)
        return torch.stack(outputs)
    if isinstance(neuron, (snn.RLeaky, snn.RSynaptic)):  # (spk, [syn,] mem) in and out
        state = (torch.zeros_like(x[0]),) * (3 if isinstance(neuron, snn.RSynaptic) else 2)
        spikes = []
        for x_t in x:
            state = neuron(linear(x_t), *state)
            spikes.append(state[0])
        return torch.stack(spikes)
    if isinstance(neuron, snn.Alpha):
        state = neuron.reset_mem()  # (syn_exc, syn_inh, mem), made to the input's shape
    elif isinstance(neuron, snn.Synaptic):
        state = neuron.init_synaptic()
    else:
        state = (neuron.init_leaky(),)
    spikes = []
    for x_t in x:
        s, *state = neuron(linear(x_t), *state)
        spikes.append(s)
    return torch.stack(spikes)


def trained(forward: Callable[[], Tensor], numba: bool = True) -> Callable[[], Tensor]:
    """One forward + backward of ``forward`` (loss: the spikes' sum), returning the spikes;
    with ``numba`` False the compiled loops are off for both passes."""

    def step() -> Tensor:
        previous, host_loops.USE_JIT = host_loops.USE_JIT, numba and host_loops.USE_JIT
        try:
            spikes = forward()
            spikes.sum().backward()
        finally:
            host_loops.USE_JIT = previous
        return spikes.detach()

    return step


def one_step(step: Callable[[], Tensor], net: nn.Module) -> tuple[float, Tensor, Tensor]:
    """Seconds of one training ``step``, its spikes and the first weight's gradient."""
    net.zero_grad(set_to_none=True)
    start = time.perf_counter()
    spikes = step()
    seconds = time.perf_counter() - start
    return seconds, spikes, net[0].weight.grad.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512, help="neurons per layer")
    parser.add_argument("--T", type=int, default=500, help="time steps")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=25, help="layer-wise chunk, in steps")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--only", nargs="*", default=[], help="substrings of neuron names")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    WIDTH[0] = args.n
    torch.manual_seed(0)
    x = (torch.rand(args.T, args.batch, args.n) < 0.05).float()
    print(
        f"Linear({args.n}, {args.n}) + neuron, batch {args.batch}, T = {args.T}, chunk "
        f"{args.chunk}, {args.threads} thread(s); min of {args.rounds} interleaved rounds"
    )
    print(
        "| neuron | its own loop | layer-wise | x loop | without Numba | x loop | neuron ran "
        "| outputs | max rel dW | peak: loop, layer-wise |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, make in NEURONS.items():
        if args.only and not any(part in name for part in args.only):
            continue
        torch.manual_seed(0)
        linear = nn.Linear(args.n, args.n)
        with torch.no_grad():
            linear.weight.mul_(4)  # the peers' gain: a few percent of the neurons fire
        net = nn.Sequential(linear, make())
        wrapped = sc.wrap(net, granularity="layer", chunk=args.chunk, storage="host")
        runs = {
            "loop": trained(lambda net=net: framework_loop(net, x)),
            "layer-wise": trained(lambda wrapped=wrapped: wrapped(x)),
            "no numba": trained(lambda wrapped=wrapped: wrapped(x), numba=False),
        }
        first = {key: one_step(run, net) for key, run in runs.items()}
        best = {key: float("inf") for key in runs}
        for _ in range(args.rounds):
            for key, run in runs.items():
                best[key] = min(best[key], one_step(run, net)[0])
        peak = {}
        for key in ("loop", "layer-wise"):
            with sc.MemoryMeter() as meter:
                one_step(runs[key], net)
            peak[key] = meter.peak_bytes / 2**20
        (_, s_loop, g_loop), (_, s_ours, g_ours) = first["loop"], first["layer-wise"]
        rel = ((g_loop - g_ours).abs().max() / g_loop.abs().max()).item()
        # spikes come out bitwise; LI's output is a membrane, where the chunk's one product
        # (the engine's) and the loop's per-step products round differently
        gap = ((s_loop - s_ours).abs().max() / s_loop.abs().max().clamp_min(1e-30)).item()
        same = "bitwise" if torch.equal(s_loop, s_ours) else f"{gap:.1e} rel"
        print(
            f"| {name} | {best['loop']:.4f} s | {best['layer-wise']:.4f} s | "
            f"{best['layer-wise'] / best['loop']:.3f} | {best['no numba']:.4f} s | "
            f"{best['no numba'] / best['loop']:.3f} | {wrapped.last_stats.blocks[0].neuron} | "
            f"{same} | {rel:.1e} | {peak['loop']:.2f}, {peak['layer-wise']:.2f} MiB |"
        )


if __name__ == "__main__":
    main()
