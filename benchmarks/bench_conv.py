"""Convolutional SNNs as snnTorch's and Norse's tutorials write them, against their own loop.

snnTorch (``nn.Sequential`` of ``init_hidden=True`` neurons, ``spk, mem = net(x_t)``, loss on
the output spikes): tutorial 6's net ``12C5-MP2-64C5-MP2-10`` on an MNIST-sized image given at
every step (batch 32, T = 25), the same with a ``BatchNorm2d`` after the first convolution,
and tutorial 7's N-MNIST net ``12C5-MP2-32C5-MP2-10`` on 2 x 34 x 34 event frames (3% ones,
batch 16, T = 100). Norse (``SequentialState``, Norse's loop): its ``ConvNet`` example
(``Conv-LIF-MaxPool`` twice, ``Linear(800, 500)``, ``LIFCell``, ``LILinearCell``) on
Poisson-coded 28 x 28 images (13% ones, batch 16, T = 32), and tutorial 7's shape with
``LIFCell`` neurons. Rows: the own loop; ``wrap`` layer-wise (``granularity="layer"``);
``granularity="auto"``; the stack with ``wrap``'s defaults. Time is the minimum of interleaved
rounds after a warm-up, in one process; peak is `spikeckpt.MemoryMeter`'s of one training step;
the gradient of the first convolution's weight relative to the loop's.

    taskset -c 1 python benchmarks/bench_conv.py --threads 1
    python benchmarks/bench_conv.py --only "tutorial 7" --T 300
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import snntorch as snn
import torch
from snntorch import utils
from torch import Tensor, nn

import spikeckpt as sc

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as norse


def _leaky(output: bool = False) -> nn.Module:
    return snn.Leaky(beta=0.5, init_hidden=True, output=output)


def tutorial6(batchnorm: bool = False) -> nn.Sequential:
    """snnTorch tutorial 6's convolutional net (``BatchNorm2d(12)`` after the first
    convolution with ``batchnorm``)."""
    norm = [nn.BatchNorm2d(12)] if batchnorm else []
    return nn.Sequential(
        nn.Conv2d(1, 12, 5), *norm, nn.MaxPool2d(2), _leaky(),
        nn.Conv2d(12, 64, 5), nn.MaxPool2d(2), _leaky(),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 10), _leaky(output=True),
    )  # fmt: skip


def tutorial7() -> nn.Sequential:
    """snnTorch tutorial 7's N-MNIST net."""
    return nn.Sequential(
        nn.Conv2d(2, 12, 5), nn.MaxPool2d(2), _leaky(),
        nn.Conv2d(12, 32, 5), nn.MaxPool2d(2), _leaky(),
        nn.Flatten(), nn.Linear(32 * 5 * 5, 10), _leaky(output=True),
    )  # fmt: skip


def norse_convnet() -> nn.Module:
    """Norse's ``ConvNet`` example: the pools after the neurons, an ``LILinearCell`` readout."""
    return norse.SequentialState(
        nn.Conv2d(1, 20, 5), norse.LIFCell(), nn.MaxPool2d(2),
        nn.Conv2d(20, 50, 5), norse.LIFCell(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(800, 500), norse.LIFCell(), norse.LILinearCell(500, 10),
    )  # fmt: skip


def norse_nmnist() -> nn.Module:
    """Tutorial 7's shape with Norse's cells, an ``LICell`` readout."""
    return norse.SequentialState(
        nn.Conv2d(2, 12, 5), nn.MaxPool2d(2), norse.LIFCell(),
        nn.Conv2d(12, 32, 5), nn.MaxPool2d(2), norse.LIFCell(),
        nn.Flatten(), nn.Linear(800, 10), norse.LICell(),
    )  # fmt: skip


def snntorch_loop(net: nn.Module, x: Tensor) -> Tensor:
    """The users' loop: ``spk, mem = net(x_t)``; the spikes ``(T, B, 10)``."""
    utils.reset(net)
    return torch.stack([net(x_t)[0] for x_t in x])


def norse_loop(net: nn.Module, x: Tensor) -> Tensor:
    """Norse's loop: ``out, state = net(x_t, state)``; the outputs ``(T, B, 10)``."""
    state, outs = None, []
    for x_t in x:
        out, state = net(x_t, state)
        outs.append(out)
    return torch.stack(outs)


@dataclass
class Case:
    """A model, its input ``(T, B, ...)`` maker and its loop."""

    make: Callable[[], nn.Module]
    batch: int
    T: int
    frame: tuple[int, ...]
    ones: float | None  # share of ones in the input's events; None: one image at every step
    loop: Callable[[nn.Module, Tensor], Tensor]


CASES: dict[str, Case] = {
    "snnTorch tutorial 6": Case(tutorial6, 32, 25, (1, 28, 28), None, snntorch_loop),
    "snnTorch tutorial 6 + BatchNorm2d": Case(
        lambda: tutorial6(batchnorm=True), 32, 25, (1, 28, 28), None, snntorch_loop
    ),
    "snnTorch tutorial 7 (N-MNIST)": Case(tutorial7, 16, 100, (2, 34, 34), 0.03, snntorch_loop),
    "Norse ConvNet (MNIST, Poisson)": Case(norse_convnet, 16, 32, (1, 28, 28), 0.13, norse_loop),
    "Norse N-MNIST conv": Case(norse_nmnist, 16, 100, (2, 34, 34), 0.03, norse_loop),
}


def inputs(case: Case, T: int, batch: int) -> Tensor:
    """Event frames with ``case.ones`` ones, or one image repeated (``expand``: the same
    tensor at every step, as tutorial 6 feeds it)."""
    if case.ones is None:
        image = torch.rand(batch, *case.frame)
        return image.expand(T, *image.shape)
    return (torch.rand(T, batch, *case.frame) < case.ones).float()


def first_weight(net: nn.Module) -> Tensor:
    return next(m for m in net.modules() if isinstance(m, nn.Conv2d)).weight


def rows(name: str, case: Case, x: Tensor, rounds: int) -> None:
    """One table row per way of running ``case``'s model on ``x``."""
    torch.manual_seed(0)
    net = case.make()
    wrapped = {
        "layer-wise": sc.wrap(net, granularity="layer"),
        'granularity="auto"': sc.wrap(net, granularity="auto"),
        "stack, wrap's defaults": sc.wrap(net),
    }
    runs: dict[str, Callable[[], Tensor]] = {"own loop": lambda: case.loop(net, x)}
    for row, seq in wrapped.items():
        runs[row] = lambda seq=seq: seq(x)[0]

    def step(run: Callable[[], Tensor]) -> tuple[float, Tensor]:
        net.zero_grad(set_to_none=True)
        start = time.perf_counter()
        run().sum().backward()
        return time.perf_counter() - start, first_weight(net).grad.clone()

    grads = {row: step(run)[1] for row, run in runs.items()}  # warm-up: plans, checks
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for row, run in runs.items():
            best[row] = min(best[row], step(run)[0])
    loop_grad = grads["own loop"]
    for row, run in runs.items():
        with sc.MemoryMeter() as meter:
            step(run)
        seq = wrapped.get(row)
        ran = "-" if seq is None else str(seq.last_stats.plan)
        rel = ((grads[row] - loop_grad).abs().max() / loop_grad.abs().max()).item()
        print(
            f"| {name} | {row} | {best[row]:.3f} s | {best[row] / best['own loop']:.2f} "
            f"| {meter.peak_bytes / 2**20:.2f} MiB | {ran} | {rel:.1e} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=None, help="time steps (default: each case's)")
    parser.add_argument("--batch", type=int, default=None, help="default: each case's")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--only", nargs="*", default=[], help="substrings of case names")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    print(f"CPU, {args.threads} thread(s); min of {args.rounds} interleaved rounds")
    print("| model | row | time | x loop | peak | plan | max rel dW |")
    print("|---|---|---|---|---|---|---|")
    for name, case in CASES.items():
        if args.only and not any(part in name for part in args.only):
            continue
        torch.manual_seed(0)
        x = inputs(case, args.T or case.T, args.batch or case.batch)
        rows(f"{name}, B {x.shape[1]}, T {x.shape[0]}", case, x, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
