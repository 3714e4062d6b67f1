"""Does ``wrap(..., plan="auto", budget=B)`` keep every first call within ``B``?

A sweep for changing the budget planner: for a few models (fully connected, convolutional,
long, deep), dense and packed inputs, ``granularity="layer"`` and ``"auto"``, disk and host
storage, it asks for the smallest budget (the refusal at 4 KiB names it) and runs one training
step at 1x to 5x that budget, each with a new wrapper, so that the planner's probes run inside
the measured call. It prints the measured peak as a share of the budget and the granularity
and chunk picked (``s``: stack, ``l12``: layer-wise, chunk 12), ``!!`` where the peak is over
the budget, and the count of those at the end (exit status 1 when there are any).

    python benchmarks/budget_sweep.py            # about 15 minutes on one CPU core
    python benchmarks/budget_sweep.py --quick    # two models, three budgets
    python benchmarks/budget_sweep.py --only wide --held   # one model, .grad held from before
    python benchmarks/budget_sweep.py --only narrow conv-b1 --no-fuse   # every neuron taped

Peaks are `MemoryMeter` peaks with the input counted, as tests/test_wrap_budget.py measures.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import Any

import snntorch as snn
import torch
from torch import nn

import spikeckpt
from spikeckpt.storage import SpikeTrain


def _fc() -> nn.Module:
    return nn.Sequential(
        nn.Linear(100, 256), snn.Leaky(beta=0.9), nn.Linear(256, 10), snn.Leaky(beta=0.9)
    )


def _conv() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 8, 3, padding=1),
        snn.Leaky(beta=0.9),
        nn.Flatten(),
        nn.Linear(8 * 12 * 12, 10),
        snn.Leaky(beta=0.9),
    )


def _deep() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128), snn.Leaky(beta=0.9),
        nn.Linear(128, 128), snn.Leaky(beta=0.9),
        nn.Linear(128, 5), snn.Leaky(beta=0.9),
    )  # fmt: skip


def _wide() -> nn.Module:
    """One wide layer: the weight's gradient outweighs the activations (a weight-bound step)."""
    return nn.Sequential(nn.Linear(1024, 1024), snn.Leaky(beta=0.9))


def _pooled() -> nn.Module:
    """A convolution pooled down to a small readout: a large membrane, little weight."""
    return nn.Sequential(
        nn.Conv2d(2, 32, 3, padding=1), snn.Leaky(beta=0.9),
        nn.AvgPool2d(4), nn.Flatten(),
        nn.Linear(32 * 3 * 3, 4), snn.Leaky(beta=0.9),
    )  # fmt: skip


def _conv16() -> nn.Module:
    """A convolution into a wide readout at batch 1: the gradient sums outweigh a short
    chunk's tape, whose line takes over past the lengths a tight probe measures."""
    return nn.Sequential(
        nn.Conv2d(2, 8, 3, padding=1), snn.Leaky(beta=0.9), nn.Flatten(),
        nn.Linear(8 * 16 * 16, 10), snn.Leaky(beta=0.9),
    )  # fmt: skip


def _narrow() -> nn.Module:
    """A wide input into a few neurons: the input's steps outweigh the layer."""
    return nn.Sequential(nn.Linear(512, 32), snn.Leaky(beta=0.9))


#: name: (model, input shape (T, B, ...), whether a packed input applies)
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], bool]] = {
    "fc": (_fc, (100, 8, 100), True),
    "conv": (_conv, (30, 4, 2, 12, 12), False),
    "fc-long": (_fc, (400, 16, 100), True),
    "deep": (_deep, (200, 8, 64), True),
    "wide": (_wide, (60, 4, 1024), True),
    "pooled": (_pooled, (30, 4, 2, 12, 12), False),
    "conv-b1": (_conv16, (400, 1, 2, 16, 16), True),
    "narrow": (_narrow, (80, 16, 512), True),
}
FACTORS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)


def _peak(
    net: nn.Module, x: Any, budget: int, granularity: str, storage: str, held: bool, fuse: bool
) -> tuple[int, Any]:
    seq = spikeckpt.wrap(net, budget=budget, granularity=granularity, storage=storage, fuse=fuse)
    net.zero_grad(set_to_none=True)
    if held:  # zeros from before the step, as when gradients accumulate
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
    with spikeckpt.MemoryMeter() as meter:
        meter.track(x.tensors() if isinstance(x, SpikeTrain) else [x])
        meter.track([p.grad for p in net.parameters() if p.grad is not None])  # in the step
        out = seq(x)
        (out * torch.arange(1, out.shape[-1] + 1)).sum().backward()
        del out
    return meter.peak_bytes, seq.last_decision


def sweep(
    cases: dict[str, Any],
    factors: tuple[float, ...],
    granularities: tuple[str, ...] = ("layer", "auto"),
    held: bool = False,
    fuse: bool = True,
) -> int:
    """Print one line per case; return the number of calls over their budget."""
    over = 0
    for name, (make, shape, packs) in cases.items():
        for form in ("dense", "packed") if packs else ("dense",):
            for granularity in granularities:
                for storage in ("disk", "host"):
                    torch.manual_seed(0)
                    net = make()
                    g = torch.Generator().manual_seed(0)
                    dense = (torch.rand(shape, generator=g) < 0.1).float()
                    x = dense if form == "dense" else SpikeTrain.from_dense(dense)
                    try:
                        _peak(net, x, 4096, granularity, storage, held, fuse)
                        raise AssertionError("a 4 KiB budget was accepted")
                    except spikeckpt.BudgetTooSmall as error:
                        smallest = error.minimum_bytes
                    cells = []
                    for factor in factors:
                        budget = int(smallest * factor)
                        peak, decision = _peak(net, x, budget, granularity, storage, held, fuse)
                        over += peak > budget
                        picked = f"l{decision.chunk}" if decision.granularity == "layer" else "s"
                        mark = "!!" if peak > budget else ""
                        cells.append(f"{factor:g}x: {peak / budget:.2f}{mark} ({picked})")
                    print(
                        f"{name:8} {form:6} {granularity:5} {storage:4} smallest {smallest:>9}  "
                        + "  ".join(cells),
                        flush=True,
                    )
    print(f"calls over their budget: {over}")
    return over


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two models, three budgets")
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), help="these models only")
    parser.add_argument(
        "--granularity", nargs="+", default=["layer", "auto"], choices=["layer", "auto", "stack"]
    )
    parser.add_argument(
        "--held", action="store_true", help="each step starts with .grad held (zeros)"
    )
    parser.add_argument(
        "--no-fuse", action="store_true", help="fuse=False: every neuron per step, taped"
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    names = args.only or (("fc", "conv") if args.quick else tuple(CASES))
    cases = {k: CASES[k] for k in names}
    factors = (1.0, 1.5, 3.0) if args.quick else FACTORS
    over = sweep(cases, factors, tuple(args.granularity), args.held, not args.no_fuse)
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
