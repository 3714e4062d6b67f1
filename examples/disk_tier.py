"""Double Checkpointing with the disk tier: remote checkpoints as files, deleted by backward.

``storage="disk"`` writes each remote checkpoint (bit-packed where it is binary) into one file,
``checkpoints.bin``, of a private ``spikeckpt-*`` folder under ``directory=``. The file exists
between the forward and the backward pass; backward reads the checkpoints back, reusing their
regions of the file as it goes, and deletes the file and folder at its end. About 10 s on 2 CPU
cores:

    python examples/disk_tier.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import spikeckpt
from spikeckpt.models import LIFStack, spike_train

T, B = 300, 8
WIDTHS = (100, 64, 10)


def checkpoint_files(parent: Path) -> list[Path]:
    return sorted(parent.glob("spikeckpt-*/checkpoints.bin"))


def main() -> None:
    # Small tensors: one thread is fastest, and on a busy machine two threads per process
    # fighting other jobs for the cores ran these examples 5-10 times slower.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LIFStack(WIDTHS)
    x = spike_train(T, B, WIDTHS[0], density=0.05)  # (T, B, 100) input spikes
    plan = spikeckpt.plans.Double(remote_interval=100, local_interval=10)
    fmt = spikeckpt.format_bytes

    with tempfile.TemporaryDirectory() as tmp, spikeckpt.MemoryMeter() as meter:
        parent = Path(tmp)
        out = spikeckpt.scan(
            model.step,
            x,
            model.initial_state(B),
            plan=plan,
            storage="disk",
            directory=parent,  # default: the system temporary folder
            readout="sum",
        )
        counts, stats = out.ys, out.stats
        during = checkpoint_files(parent)  # one file, whatever the number of checkpoints
        size = fmt(sum(path.stat().st_size for path in during))
        print(f"after forward: {during[0].parent.name}/{during[0].name} holds {size}")
        counts.sum().backward()
        after = list(parent.iterdir())
        print(f"after backward: {len(after)} files or folders left under {parent}")

    print(f"plan: {stats.plan}, T={stats.T}, storage={stats.storage!r}")
    print(
        f"written to disk: {fmt(stats.bytes_written['disk'])}, read back: "
        f"{fmt(stats.bytes_read['disk'])}, peak on disk: {fmt(stats.storage_ledger.peak['disk'])}"
    )
    print(f"evaluations per step: {stats.recompute_factor:.2f}, completed: {stats.completed}")
    # Plain BPTT's modeled need, from the measured S and A: S + T*A.
    S, A = stats.state_bytes, round(stats.tape_bytes_per_step)
    bptt = spikeckpt.plans.BPTT().cost(T, state_bytes=S, step_bytes=A).peak_bytes
    print(f"peak tensor memory of the step (MemoryMeter): {fmt(meter.peak_bytes)}")
    print(f"plain BPTT would keep S + T*A = {fmt(bptt)} of tapes and state")
    assert during and not after and stats.completed


if __name__ == "__main__":
    main()
