"""Layer-wise time against the chunk length, on a small net: the fixed cost of a chunk.

A small snnTorch net (``Linear(100, 128)``, ``Leaky``, ``Linear(128, 10)``, ``Leaky(output=True)``,
``init_hidden=True``, batch 16, T = 100, 10% input spikes, loss on the output spikes) wrapped
with ``granularity="layer"`` at several chunk lengths, against snnTorch's own loop. Each chunk
runs every block three times (forward, recomputation, backward) through Python: with short
chunks that fixed cost is what a step costs (the planner picks short chunks under tight
budgets, and ``granularity="auto"`` without one). Time is the minimum of interleaved rounds
in one process.

    taskset -c 1 python benchmarks/bench_chunks.py --threads 1
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import snntorch as snn
import torch
from snntorch import utils
from torch import Tensor, nn

import spikeckpt as sc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=100, help="time steps")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, nargs="*", default=[2, 4, 10, 25, 100])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timed rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(100, 128),
        snn.Leaky(0.9, init_hidden=True),
        nn.Linear(128, 10),
        snn.Leaky(0.9, init_hidden=True, output=True),
    )
    x = (torch.rand(args.T, args.batch, 100) < 0.1).float()

    def loop() -> Tensor:
        utils.reset(net)
        return torch.stack([net(x_t)[0] for x_t in x])

    runs: dict[str, Callable[[], Tensor]] = {"snnTorch loop": loop}
    for k in args.chunks:
        seq = sc.wrap(net, granularity="layer", chunk=k)
        runs[f"layer-wise, chunk {k}"] = lambda seq=seq: seq(x)[0]
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, run in runs.items():
            net.zero_grad(set_to_none=True)
            start = time.perf_counter()
            run().sum().backward()
            best[name] = min(best[name], time.perf_counter() - start)
    loop_time = best["snnTorch loop"]
    print(
        f"100-128-10, batch {args.batch}, T = {args.T}, {args.threads} thread(s); "
        f"min of {args.rounds} interleaved rounds"
    )
    print("| run | time | x loop |")
    print("|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e3:.2f} ms | {seconds / loop_time:.2f} |")


if __name__ == "__main__":
    main()
