"""A snnTorch network trained the tutorial way, then the same network wrapped by spikeckpt.

Prints the peak tensor memory of one forward+backward for both (``spikeckpt.MemoryMeter``) and
the largest gradient difference. 10-20 s on 2 CPU cores, most of it starting Python and torch:

    python examples/snntorch_wrap.py
"""

from __future__ import annotations

import snntorch as snn
import torch
from torch import nn

import spikeckpt

T, B, IN, HID, OUT = 200, 16, 100, 128, 10


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, HID),
        snn.Leaky(beta=0.9, learn_beta=True),
        nn.Linear(HID, OUT),
        snn.Leaky(beta=0.9, learn_threshold=True),
    )


def tutorial_loss(net: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The snnTorch tutorial loop: explicit membranes, one call per step."""
    fc1, lif1, fc2, lif2 = net
    mem1, mem2 = lif1.init_leaky(), lif2.init_leaky()
    count = 0
    for t in range(x.shape[0]):
        spk1, mem1 = lif1(fc1(x[t]), mem1)
        spk2, mem2 = lif2(fc2(spk1), mem2)
        count = count + spk2
    return nn.functional.cross_entropy(count / 10, target)


def main() -> None:
    # Small tensors: one thread is fastest, and on a busy machine two threads per process
    # fighting other jobs for the cores ran these examples 5-10 times slower.
    torch.set_num_threads(1)
    x = (torch.rand(T, B, IN) < 0.05).float()  # 5% input spikes
    target = torch.randint(0, OUT, (B,))

    net = build()
    with spikeckpt.MemoryMeter() as loop_mem:
        tutorial_loss(net, x, target).backward()
    loop_grads = [p.grad.clone() for p in net.parameters()]

    net.zero_grad()
    seq = spikeckpt.wrap(net, plan=spikeckpt.plans.Revolve(8), readout="sum")
    with spikeckpt.MemoryMeter() as wrap_mem:
        count = seq(x)  # (B, OUT) spike counts, summed inside the checkpointed loop
        nn.functional.cross_entropy(count / 10, target).backward()
    diff = max(
        (a - p.grad).abs().max().item() for a, p in zip(loop_grads, net.parameters(), strict=True)
    )

    print(f"T={T}, batch {B}: {IN}-{HID}-{OUT} Leaky network; peak memory of a training step:")
    print(f"  tutorial loop: {spikeckpt.format_bytes(loop_mem.peak_bytes)}")
    print(f"  wrapped, {seq.plan!r}: {spikeckpt.format_bytes(wrap_mem.peak_bytes)}")
    print(f"max gradient difference: {diff:.3g}")


if __name__ == "__main__":
    main()
