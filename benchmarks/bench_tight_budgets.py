"""Layer-wise plans under tight budgets with a packed input: the chunk the planner picks, the
step's peak against the budget, and its time.

An SHD-shaped snnTorch net (700 -> 256 -> 20 ``Leaky``, batch 32, T = 1000, 3% input spikes
packed in a ``SpikeTrain``), ``wrap(net, plan="auto", budget=B, granularity="layer")`` at
budgets of 10 to 24 MiB: per budget the chunk the planner picks, the first call's peak with
the input counted (probes included, `MemoryMeter`) as a share of the budget, and the time of
a training step (forward + backward, min of interleaved rounds after the first call).

    python benchmarks/bench_tight_budgets.py --threads 1
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_tight_budgets.py  # before/after
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import snntorch as snn
import torch
from torch import nn

import spikeckpt
from spikeckpt import MemoryMeter, SpikeTrain

MIB = 1 << 20


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(700, 256), snn.Leaky(beta=0.95), nn.Linear(256, 20), snn.Leaky(beta=0.95)
    )


def _step(seq: nn.Module, net: nn.Module, x: SpikeTrain) -> None:
    net.zero_grad(set_to_none=True)
    seq(x).sum().backward()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[10, 12, 16, 24], help="MiB")
    parser.add_argument("--T", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--density", type=float, default=0.03)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    dense = torch.rand(args.T, args.batch, 700, generator=generator) < args.density
    x = SpikeTrain.from_dense(dense.float())
    del dense
    net = _net()
    runs: dict[float, Any] = {}
    for mib in args.budgets:
        budget = int(mib * MIB)
        seq = spikeckpt.wrap(net, plan="auto", budget=budget, readout="sum", granularity="layer")
        with MemoryMeter() as meter:
            meter.track(x.tensors())
            start = time.perf_counter()
            _step(seq, net, x)
            first = time.perf_counter() - start
        runs[mib] = (seq, seq.last_decision.chunk, meter.peak_bytes / budget, first)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.repeats):
        for mib, (seq, *_rest) in runs.items():
            start = time.perf_counter()
            _step(seq, net, x)
            best[mib] = min(best[mib], time.perf_counter() - start)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s); 700-256-20 Leaky, T = {args.T}, "
        f"batch {args.batch}, {args.density:.0%} spikes packed ({x.nbytes / MIB:.2f} MiB)"
    )
    print("| budget | chunk | first call peak / budget | first call | step (min) |")
    print("|---|---|---|---|---|")
    for mib, (_seq, chunk, share, first) in runs.items():
        print(f"| {mib:g} MiB | {chunk} | {share:.3f} | {first:.2f} s | {best[mib]:.3f} s |")


if __name__ == "__main__":
    main()
