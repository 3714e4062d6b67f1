"""CPU cost of a checkpoint's round trip through each storage tier (a script, not a test).

A round trip is what the executor does with a remote checkpoint: ``put`` in the forward pass,
``prefetch`` of the next one and ``get`` and ``drop`` in the backward pass. The state is that
of a two-layer LIF stack: for each layer a dense float membrane and a binary float spike
tensor, ``(batch, width)`` each. Prints the CPU time of the process (all threads) per round
trip, the minimum over ``--rounds`` rounds of ``--checkpoints`` round trips; the disk tier
twice: small checkpoints on the calling thread (the default) and every checkpoint through its
I/O thread (``background_bytes=0``).

    taskset -c 1 python benchmarks/bench_tiers.py --threads 1
    taskset -c 1 python benchmarks/bench_tiers.py --threads 1 --widths 65536 --batch 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from spikeckpt.storage.base import Ledger
from spikeckpt.storage.disk import DiskStore
from spikeckpt.storage.host import HostStore


def lif_state(batch: int, widths: list[int], density: float, seed: int = 0) -> list[torch.Tensor]:
    """``[membrane, spikes]`` per layer, ``(batch, width)`` float32 each."""
    gen = torch.Generator().manual_seed(seed)
    state = []
    for width in widths:
        state.append(torch.randn(batch, width, generator=gen))
        state.append((torch.rand(batch, width, generator=gen) < density).float())
    return state


def round_trip_seconds(store: object, state: list[torch.Tensor], n: int, rounds: int) -> float:
    """CPU seconds per round trip: ``n`` puts, then in reverse a prefetch, get and drop each."""
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for key in range(n):
            store.put(key, state)  # type: ignore[attr-defined]
        for key in reversed(range(n)):
            if key > 0:
                store.prefetch(key - 1)  # type: ignore[attr-defined]
            store.get(key)  # type: ignore[attr-defined]
            store.drop(key)  # type: ignore[attr-defined]
        best = min(best, (time.process_time() - start) / n)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 10])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--checkpoints", type=int, default=31)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    state = lif_state(args.batch, args.widths, args.density)
    dense = sum(t.numel() * t.element_size() for t in state)
    with tempfile.TemporaryDirectory() as folder:
        stores = {
            "host": HostStore("cpu", Ledger()),
            "disk (calling thread)": DiskStore(
                "cpu", Ledger(), folder, background_bytes=sys.maxsize
            ),
            "disk (I/O thread)": DiskStore("cpu", Ledger(), folder, background_bytes=0),
        }
        times = {name: float("inf") for name in stores}
        for _ in range(2):  # interleaved: each store's minimum over both passes
            for name, store in stores.items():
                seconds = round_trip_seconds(store, state, args.checkpoints, args.rounds)
                times[name] = min(times[name], seconds)
        held = stores["host"].ledger.peak.get("host", 0) // args.checkpoints
        for store in stores.values():
            store.close()
    print(
        f"state: widths {args.widths}, batch {args.batch}, spike density {args.density}: "
        f"{dense} B dense, {held} B packed; {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch thread(s), load {os.getloadavg()[0]:.2f}"
    )
    print("| tier | CPU time per round trip |")
    print("|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1e6:.0f} us |")


if __name__ == "__main__":
    main()
