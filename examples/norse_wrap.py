"""A Norse network run the tutorial way, then the same network wrapped by spikeckpt.

Prints the peak tensor memory of one forward+backward for both (``spikeckpt.MemoryMeter``) and
the largest gradient difference. 10-20 s on 2 CPU cores, most of it starting Python and torch:

    python examples/norse_wrap.py
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # norse: torch.jit.script is deprecated
    import norse.torch as norse

import spikeckpt

T, B, IN, HID, OUT = 200, 16, 100, 128, 10


def build() -> nn.Module:
    torch.manual_seed(0)
    return norse.SequentialState(
        nn.Linear(IN, HID),
        norse.LIFRecurrentCell(HID, HID),
        nn.Linear(HID, OUT),
        norse.LICell(),
    )


def tutorial_loss(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The Norse tutorial loop: ``state = None``, one call per step."""
    state, out = None, []
    for t in range(x.shape[0]):
        v, state = model(x[t], state)
        out.append(v)
    voltages = torch.stack(out)  # (T, B, OUT)
    return nn.functional.cross_entropy(voltages.max(0).values, target)


def main() -> None:
    # Small tensors: one thread is fastest, and on a busy machine two threads per process
    # fighting other jobs for the cores ran these examples 5-10 times slower.
    torch.set_num_threads(1)
    x = (torch.rand(T, B, IN) < 0.05).float()
    target = torch.randint(0, OUT, (B,))

    model = build()
    with spikeckpt.MemoryMeter() as loop_mem:
        tutorial_loss(model, x, target).backward()
    loop_grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    # readout="max": torch.max(voltages, 0) inside the loop, its gradient to the first of ties
    seq = spikeckpt.wrap(model, plan=spikeckpt.plans.Double(50, 10), readout="max")
    with spikeckpt.MemoryMeter() as wrap_mem:
        out, _ = seq(x)  # (running max, final state): Norse's (output, state) convention
        nn.functional.cross_entropy(out, target).backward()
    diff = max(
        (a - p.grad).abs().max().item() for a, p in zip(loop_grads, model.parameters(), strict=True)
    )

    print(f"T={T}, batch {B}: {IN}-{HID}(recurrent LIF)-{OUT}(LI) network; peak memory:")
    print(f"  tutorial loop: {spikeckpt.format_bytes(loop_mem.peak_bytes)}")
    print(f"  wrapped, {seq.plan!r}: {spikeckpt.format_bytes(wrap_mem.peak_bytes)}")
    print(f"max gradient difference: {diff:.3g}")


if __name__ == "__main__":
    main()
