"""A batch-first input against a time-first one, under ``granularity="auto"``.

snnTorch ``Linear(700, 256)``, ``Leaky(0.9)``, ``Linear(256, 20)``, ``Leaky(0.9)`` (an SHD-sized
net), batch 32, T = 200, 3% input spikes, loss the output spikes' sum. The same input three
ways: time-first and contiguous ``(T, B, 700)``; ``x.permute(1, 0, 2)`` of a batch-first
``(B, T, 700)`` tensor (a strided view, as a batch-first data loader's batch transposed); and
the batch-first tensor itself with ``wrap(..., batch_first=True)``. Per row: the plan the
planner picked, the least of interleaved timed rounds (forward + backward, one process, after
one untimed call that plans) and the step's peak under ``MemoryMeter``.

    taskset -c 1 python benchmarks/bench_layout.py --threads 1
"""

from __future__ import annotations

import argparse
import time
import warnings

import snntorch as snn
import torch
from torch import Tensor, nn

import spikeckpt as sc


def _net(n_in: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, 256), snn.Leaky(0.9), nn.Linear(256, 20), snn.Leaky(0.9))


def _step(model: nn.Module, x: Tensor) -> None:
    model(x).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=200, help="time steps")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--inputs", type=int, default=700)
    parser.add_argument("--density", type=float, default=0.03, help="input spike density")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved timed rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, args.T, args.inputs)
    batch_first = (torch.rand(shape, generator=generator) < args.density).float()
    rows = {
        "time-first, contiguous": (
            sc.wrap(_net(args.inputs), granularity="auto"),
            batch_first.transpose(0, 1).contiguous(),
        ),
        "x.permute(1, 0, 2)": (
            sc.wrap(_net(args.inputs), granularity="auto"),
            batch_first.permute(1, 0, 2),
        ),
        "batch_first=True": (
            sc.wrap(_net(args.inputs), granularity="auto", batch_first=True),
            batch_first,
        ),
    }
    peaks = {}
    for name, (model, x) in rows.items():
        _step(model, x)  # plans
        with sc.MemoryMeter() as meter:
            _step(model, x)
        peaks[name] = meter.peak_bytes
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(args.rounds):
        for name, (model, x) in rows.items():
            start = time.perf_counter()
            _step(model, x)
            best[name] = min(best[name], time.perf_counter() - start)
    first = best["time-first, contiguous"]
    print("| input | plan | time | x time-first | peak |")
    print("|---|---|---|---|---|")
    for name, (model, _x) in rows.items():
        print(
            f"| {name} | {model.last_stats.plan} | {best[name] * 1e3:.1f} ms | "
            f"{best[name] / first:.2f} | {peaks[name] / 2**20:.2f} MiB |"
        )


if __name__ == "__main__":
    main()
