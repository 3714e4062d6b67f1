"""Recurrent snnTorch and Norse layers as SHD models write them, against their own loop.

``nn.Sequential(Linear(700, H), RLeaky | RSynaptic(linear_features=H, init_hidden=True),
Linear(H, 20), Leaky(init_hidden=True, output=True))``, input spikes at 5%, loss on the output
membrane (``spk, mem = net(x_t)``), batch 32; and Norse's ``SequentialState(LIFRecurrentCell(700,
H) | LSNNRecurrentCell(700, H), Linear(H, 20), LICell())`` (``--readout lilinear``: Norse's usual
readout ``LILinearCell(H, 20)`` in place of the last two), and the feed-forward
``SequentialState(Linear(700, H), LIFCell(), ...)`` beside them, against Norse's loop. Rows: snnTorch's
own loop; ``wrap`` layer-wise with the recurrent neuron fused
(`spikeckpt.adapters.recurrent_kernel`, `spikeckpt.adapters.lsnn_kernel`) and per step
(``fuse=False``: as before the kernel); the stack with ``wrap``'s defaults; ``BPTT()``; and
``granularity="auto"``. Time is the minimum of interleaved rounds after a warm-up, in one
process; peak is `spikeckpt.MemoryMeter`'s (live tensors on the CPU, the allocator on CUDA) of
one training step; the gradient of the first ``Linear`` relative to the loop's.

    taskset -c 1 python benchmarks/bench_recurrent.py --T 500 --threads 1
    python benchmarks/bench_recurrent.py --device cuda --rounds 1   # on a GPU

A row whose timed call planned again (probes inside the timed step) says so in its "neuron
ran" column, and the script then exits 1: the row did not time the step alone (on an H200
such a re-plan made a fused row 2.14x the loop instead of 0.54x).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable

import snntorch as snn
import torch
from snntorch import utils
from torch import Tensor, nn

import spikeckpt as sc

NEURONS: dict[str, Callable[[int], nn.Module]] = {
    "RLeaky": lambda h: snn.RLeaky(beta=0.9, linear_features=h, init_hidden=True),
    # alpha = beta = 0.9 here: the loop's own gradient overflows to inf / nan by T = 500
    "RSynaptic": lambda h: snn.RSynaptic(alpha=0.5, beta=0.5, linear_features=h, init_hidden=True),
}


def shd_net(neuron: nn.Module, hidden: int) -> nn.Sequential:
    """700 -> ``hidden`` (the recurrent neuron) -> 20 (``Leaky``, ``output=True``)."""
    return nn.Sequential(
        nn.Linear(700, hidden),
        neuron,
        nn.Linear(hidden, 20),
        snn.Leaky(beta=0.9, init_hidden=True, output=True),
    )


def snntorch_loop(net: nn.Module, x: Tensor) -> Tensor:
    """The users' loop: ``spk, mem = net(x_t)``; the membranes ``(T, B, 20)``."""
    utils.reset(net)
    return torch.stack([net(x_t)[1] for x_t in x])


def norse_net(
    hidden: int, learn_p: bool = False, kind: str = "lif", lilinear: bool = False
) -> nn.Module | None:
    """Norse's ``SequentialState(LIFRecurrentCell(700, hidden), Linear(hidden, 20),
    LICell())`` (``kind="lsnn"``: ``LSNNRecurrentCell``; ``"feed-forward"``: ``Linear(700,
    hidden), LIFCell()``; ``lilinear``: ``LILinearCell(hidden, 20)`` as the readout; None
    without Norse); ``learn_p``: the LIF cell's ``tau_mem_inv`` (per neuron) and ``v_th`` are
    parameters."""
    try:
        import norse.torch as norse
    except ImportError:  # pragma: no cover - norse is an extra
        return None
    first: list[nn.Module] = []
    if kind == "lsnn":
        cell: nn.Module = norse.LSNNRecurrentCell(700, hidden)
    elif kind == "feed-forward":
        first, cell = [nn.Linear(700, hidden)], norse.LIFCell()
    elif learn_p:
        p = norse.LIFParameters(
            tau_mem_inv=nn.Parameter(torch.full((hidden,), 100.0)),
            v_th=nn.Parameter(torch.tensor(1.0)),
        )
        cell = norse.LIFRecurrentCell(700, hidden, p=p)
    else:
        cell = norse.LIFRecurrentCell(700, hidden)
    if lilinear:
        return norse.SequentialState(*first, cell, norse.LILinearCell(hidden, 20))
    return norse.SequentialState(*first, cell, nn.Linear(hidden, 20), norse.LICell())


def norse_loop(net: nn.Module, x: Tensor) -> Tensor:
    """Norse's loop: ``v, state = net(x_t, state)``; the output membranes ``(T, B, 20)``."""
    state, out = None, []
    for x_t in x:
        v, state = net(x_t, state)
        out.append(v)
    return torch.stack(out)


#: seconds of planning in a timed call past which the row says so (a reused plan: microseconds,
#: up to 5 ms on a loaded 2-core machine; planning again: 0.1 s and more, its probes)
PLANNING_NOTED = 0.02


def rows(
    name: str,
    net: nn.Module,
    x: Tensor,
    rounds: int,
    loop: Callable[[nn.Module, Tensor], Tensor] = snntorch_loop,
    pick: int = 1,
    budget: str | None = None,
) -> int:
    """Time, peak and gradient of each row for ``net`` (its own ``loop``; the wrapped
    model's output ``pick`` of its call's tuple); one table row each. Returns how many rows
    planned again in a timed call."""
    wrapped = {
        "layer-wise, fused": sc.wrap(net, granularity="layer", budget=budget),
        "layer-wise, per step": sc.wrap(net, granularity="layer", fuse=False, budget=budget),
        "stack, wrap's defaults": sc.wrap(net, budget=budget),
        "stack, BPTT()": sc.wrap(net, plan=sc.plans.BPTT(), budget=budget),
        'granularity="auto"': sc.wrap(net, granularity="auto", budget=budget),
    }
    runs: dict[str, Callable[[], Tensor]] = {"own loop": lambda: loop(net, x)}
    for row, seq in wrapped.items():
        runs[row] = lambda seq=seq: seq(x)[pick]

    def step(run: Callable[[], Tensor]) -> tuple[float, Tensor]:
        net.zero_grad(set_to_none=True)
        _sync(x.device)
        start = time.perf_counter()
        run().sum().backward()
        _sync(x.device)
        return time.perf_counter() - start, first_weight(net).grad.clone()

    grads = {row: step(run)[1] for row, run in runs.items()}  # warm-up: plans, checks
    best = dict.fromkeys(runs, float("inf"))
    planned: dict[str, float] = {}  # the most seconds a timed call spent choosing its plan
    for _ in range(rounds):
        for row, run in runs.items():
            best[row] = min(best[row], step(run)[0])
            if row in wrapped:
                seconds = wrapped[row].last_stats.planning_seconds
                planned[row] = max(planned.get(row, 0.0), seconds)
    loop_grad = grads["own loop"]
    for row, run in runs.items():
        with sc.MemoryMeter(x.device) as meter:
            step(run)
        seq = wrapped.get(row)
        ran = "-"
        if seq is not None and seq.last_stats.granularity == "layer":
            blocks = "; ".join(b.neuron for b in seq.last_stats.blocks)
            ran = f"{seq.last_stats.plan}: {blocks}"
        elif seq is not None:
            ran = f"stack, {seq.last_stats.plan}"
        if planned.get(row, 0.0) > PLANNING_NOTED:
            ran += f" (planned again in a timed call: {planned[row]:.3f} s)"
        rel = ((grads[row] - loop_grad).abs().max() / loop_grad.abs().max()).item()
        print(
            f"| {name} | {row} | {best[row]:.3f} s | {best[row] / best['own loop']:.2f} "
            f"| {meter.peak_bytes / 2**20:.2f} MiB | {ran} | {rel:.1e} |"
        )
    return sum(seconds > PLANNING_NOTED for seconds in planned.values())


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously: time what it ran)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_weight(net: nn.Module) -> Tensor:
    """The first layer's weight (``Linear.weight``, or a Norse cell's input weights)."""
    first = next(iter(net.children()))
    return first.weight if isinstance(first, nn.Linear) else first.input_weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=500, help="time steps")
    parser.add_argument("--hidden", type=int, default=256, help="recurrent neurons")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--only", nargs="*", default=[], help="substrings of neuron names")
    parser.add_argument(
        "--learn-p", action="store_true", help="Norse LIF: tau_mem_inv, v_th learnable"
    )
    parser.add_argument(
        "--readout",
        choices=("linear-li", "lilinear"),
        default="linear-li",
        help="Norse's readout: Linear(H, 20) + LICell(), or LILinearCell(H, 20)",
    )
    parser.add_argument(
        "--budget",
        default=None,
        help="every wrapped row plans to this budget (e.g. 1GiB), as on a GPU, where "
        "plan='auto' without one plans to the free memory",
    )
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    x = (torch.rand(args.T, args.batch, 700) < 0.05).float().to(device)
    print(
        f"700-{args.hidden}-20, batch {args.batch}, T = {args.T}, {device}, "
        f"{args.threads} thread(s); "
        f"min of {args.rounds} interleaved rounds"
    )
    print("| neuron | row | time | x loop | peak | neuron ran | max rel dW |")
    print("|---|---|---|---|---|---|---|")
    replanned = 0
    for name, make in NEURONS.items():
        if args.only and not any(part in name for part in args.only):
            continue
        torch.manual_seed(0)
        net = shd_net(make(args.hidden), args.hidden).to(device)
        replanned += rows(name, net, x, args.rounds, budget=args.budget)
    norse_nets = {
        "Norse LIFRecurrentCell": "lif",
        "Norse LSNNRecurrentCell": "lsnn",
        "Norse LIFCell (feed-forward)": "feed-forward",
    }
    for name, kind in norse_nets.items():
        if args.only and not any(part in name for part in args.only):
            continue
        torch.manual_seed(0)
        net = norse_net(args.hidden, args.learn_p, kind, args.readout == "lilinear")
        if net is not None:
            replanned += rows(name, net.to(device), x, args.rounds, norse_loop, 0, args.budget)
    if replanned:
        print(f"{replanned} row(s) planned again in a timed call", file=sys.stderr)
    return 1 if replanned else 0


if __name__ == "__main__":
    raise SystemExit(main())
