"""How often a budget re-plans on data padded per batch: SHD files, ``plan="auto"``.

snnTorch ``Linear(700, 256)``, ``Leaky(0.95)``, ``Linear(256, 20)``, ``Leaky(0.95)`` wrapped with
``plan="auto"``, ``granularity="auto"``, ``readout="sum"`` and a device budget, trained with
Adam on the batches of ``SHDDataModule`` (packed, each batch padded to its longest sample, so
its length and its spike count vary; synthetic files in the real format where ``--root`` has
no SHD). Printed per batch: its length, the plan it ran, the seconds it spent planning (the
probes of a new or denser shape) and the whole training step's; with ``--meter``, the step's
peak under ``MemoryMeter`` with its input (beside the budget: the meter slows the step down).

    taskset -c 1 python benchmarks/bench_replans.py --threads 1
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from contextlib import nullcontext

import snntorch as snn
import torch
from torch import nn

import spikeckpt as sc
from spikeckpt.data import SHDDataModule
from spikeckpt.engine.inputs import input_nbytes
from spikeckpt.units import format_bytes, parse_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="folder with SHD/ (default: synthetic)")
    parser.add_argument("--budget", default="12MiB", help="device budget of a training step")
    parser.add_argument("--batches", type=int, default=18)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dt-us", type=int, default=1000, help="bin width (microseconds)")
    parser.add_argument("--meter", action="store_true", help="measure each step's peak")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        data = SHDDataModule(
            root=args.root or scratch,
            dt_us=args.dt_us,
            batch_size=args.batch,
            synthetic=args.root is None,
            synthetic_samples=args.batch * args.batches,
            packed=True,
        )
        data.setup()
        net = nn.Sequential(
            nn.Linear(700, 256), snn.Leaky(0.95), nn.Linear(256, 20), snn.Leaky(0.95)
        )
        seq = sc.wrap(net, plan="auto", budget=args.budget, readout="sum", granularity="auto")
        optimizer = torch.optim.Adam(seq.parameters(), lr=1e-3)
        budget = parse_bytes(args.budget)
        steps = planning = 0.0
        probed = 0
        for i, (x, y) in enumerate(data.train_dataloader()):
            if i == args.batches:
                break
            optimizer.zero_grad(set_to_none=True)
            meter = sc.MemoryMeter() if args.meter else nullcontext()
            start = time.perf_counter()
            with meter:
                nn.functional.cross_entropy(seq(x), y).backward()
            optimizer.step()
            took = time.perf_counter() - start
            stats = seq.last_stats
            steps, planning = steps + took, planning + stats.planning_seconds
            probed += stats.planning_seconds > 0.05
            peak = ""
            if isinstance(meter, sc.MemoryMeter):
                held = meter.peak_bytes + input_nbytes(x)
                peak = f", peak {format_bytes(held)} ({held / budget:.2f} of the budget)"
            print(
                f"batch {i}: T={x.shape[0]}, {stats.plan}, planning {stats.planning_seconds:.3f}"
                f" s, step {took:.3f} s{peak}"
            )
    print(
        f"{probed} of {min(i + 1, args.batches)} batches planned; {planning:.2f} s of the steps'"
        f" {steps:.2f} s spent planning"
    )


if __name__ == "__main__":
    main()
