"""The overhead-bound case: three layers of 8 snnTorch neurons, batch 1, T = 2000.

A step is a few dozen tiny operations, so the time is per-operation dispatch: what a small SNN
step costs on a GPU. Rows: the plain snnTorch loop; spikeckpt's stack granularity with
`BPTT()` and with `plan="auto"` at 5% of the loop's peak, eager and with ``compile=True`` (the
step compiled, `spikeckpt.engine.compiled_step`; its first call compiles). The budget is 5%
of the eager `BPTT()` step's peak (``MemoryMeter``'s default tensor mode, as the planner
counts) plus the input. Time is the minimum of interleaved rounds after a warm-up, in one
process. Two peaks per row: ``MemoryMeter()`` (tensors; under it a compiled step runs eagerly,
so a compiled row shows its eager step) and ``MemoryMeter(mode="allocator")`` (the
allocator's events: compiled rows as they run, with whatever else the process allocates).

    taskset -c 1 python benchmarks/bench_overhead.py --threads 1
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


def network(n: int) -> nn.Sequential:
    """Three ``Linear(n, n)`` + ``Leaky`` layers."""
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(n, n), snn.Leaky(beta=0.9)]
    return nn.Sequential(*layers)


def plain_loop(net: nn.Sequential, x: Tensor) -> Tensor:
    """snnTorch's loop as its tutorials write it: the output spikes summed over time."""
    neurons = [m for m in net if isinstance(m, snn.Leaky)]
    mems = [m.init_leaky() for m in neurons]
    total: Tensor | int = 0
    for x_t in x:
        h, j = x_t, 0
        for layer in net:
            if isinstance(layer, snn.Leaky):
                h, mems[j] = layer(h, mems[j])
                j += 1
            else:
                h = layer(h)
        total = total + h
    assert isinstance(total, Tensor)
    return total


def timed(run: Callable[[], Tensor], net: nn.Module) -> tuple[float, Tensor, list[Tensor]]:
    """Seconds of one forward + backward (loss: the output's sum), the output, the grads."""
    net.zero_grad(set_to_none=True)
    start = time.perf_counter()
    out = run()
    out.sum().backward()
    seconds = time.perf_counter() - start
    return seconds, out.detach(), [p.grad.clone() for p in net.parameters()]


def peak(run: Callable[[], Tensor], net: nn.Module, mode: str = "tensors") -> int:
    """Peak bytes of one training step under ``MemoryMeter(mode=mode)``."""
    net.zero_grad(set_to_none=True)
    with sc.MemoryMeter(mode=mode) as meter:
        run().sum().backward()
    return meter.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=2000)
    parser.add_argument("--n", type=int, default=8, help="neurons per layer")
    parser.add_argument("--share", type=float, default=5.0, help="budget, %% of the loop's peak")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    net = network(args.n)
    x = (torch.rand(args.T, 1, args.n) < 0.3).float()
    bptt_peak = peak(lambda: sc.wrap(net, plan=sc.plans.BPTT(), readout="sum")(x), net)
    budget = int(args.share / 100 * bptt_peak) + x.numel() * x.element_size()
    wrapped = {}
    for compile_ in (False, True):
        tag = "compiled" if compile_ else "eager"
        wrapped[f"BPTT(), {tag}"] = sc.wrap(
            net, plan=sc.plans.BPTT(), readout="sum", compile=compile_
        )
        wrapped[f"auto at {args.share:g}%, {tag}"] = sc.wrap(
            net, plan="auto", budget=budget, readout="sum", compile=compile_
        )
    runs: dict[str, Callable[[], Tensor]] = {"snnTorch loop": lambda: plain_loop(net, x)}
    runs |= {name: (lambda seq=seq: seq(x)) for name, seq in wrapped.items()}
    first = {}
    for name, run in runs.items():
        start = time.perf_counter()
        first[name] = timed(run, net)
        first[name] = (time.perf_counter() - start, *first[name][1:])
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.rounds):
        for name, run in runs.items():
            best[name] = min(best[name], timed(run, net)[0])
    print(
        f"3 x (Linear({args.n}, {args.n}) + Leaky), batch 1, T = {args.T}, {args.threads} "
        f"thread(s); min of {args.rounds} interleaved rounds; BPTT() peak {bptt_peak} B, "
        f"budget {budget} B"
    )
    print(
        "| row | plan | first call | time | x loop | peak (tensors) | x BPTT | peak (allocator) "
        "| max rel dW |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    _, out_loop, grads_loop = first["snnTorch loop"]
    for name, run in runs.items():
        seq = wrapped.get(name)
        plan = seq.last_stats.plan if seq is not None else "-"
        compiled = " (ran compiled)" if seq is not None and seq.last_stats.step_compiled else ""
        grads = first[name][2]
        rel = max(
            float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
            for a, b in zip(grads_loop, grads, strict=True)
        )
        used, held = peak(run, net), peak(run, net, "allocator")
        print(
            f"| {name} | {plan}{compiled} | {first[name][0]:.2f} s | {best[name]:.3f} s | "
            f"{best[name] / best['snnTorch loop']:.2f} | {used} B | {used / bptt_peak:.3f} | "
            f"{held} B | {rel:.1e} |"
        )


if __name__ == "__main__":
    main()
