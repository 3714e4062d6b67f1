"""snnTorch tutorial 5's network and loop, then the same network wrapped layer-wise.

Tutorial 5 feeds one image at every step (``cur1 = self.fc1(x)`` inside its time loop). Wrapped,
the loop moves into spikeckpt: pass the image as a view repeated over time,
``img.expand(num_steps, *img.shape)`` (no copy), and ``granularity="layer"`` runs each layer
over chunks of steps, the first layer once per chunk since its input does not change, the
neurons fused over the chunk. Prints the time and the peak tensor memory of one training step
for both (``spikeckpt.MemoryMeter``), the largest gradient difference, and whether the output
spikes are the loop's. 10-20 s on 2 CPU cores, most of it starting Python and torch:

    python examples/snntorch_tutorial5.py
"""

from __future__ import annotations

import time

import snntorch as snn
import torch
from snntorch import utils
from torch import nn

import spikeckpt

NUM_INPUTS, NUM_HIDDEN, NUM_OUTPUTS, NUM_STEPS, BATCH, BETA = 784, 1000, 10, 25, 128, 0.95


def build() -> nn.Sequential:
    """Tutorial 5's layers, as an ``nn.Sequential`` (snnTorch's ``init_hidden=True`` form)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(NUM_INPUTS, NUM_HIDDEN),
        snn.Leaky(beta=BETA, init_hidden=True),
        nn.Linear(NUM_HIDDEN, NUM_OUTPUTS),
        snn.Leaky(beta=BETA, init_hidden=True, output=True),
    )


def tutorial_loop(net: nn.Sequential, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tutorial's time loop: the same image at every step; ``(spikes, membranes)``."""
    utils.reset(net)
    spk_rec, mem_rec = [], []
    for _ in range(NUM_STEPS):
        spk, mem = net(img)
        spk_rec.append(spk)
        mem_rec.append(mem)
    return torch.stack(spk_rec), torch.stack(mem_rec)


def loss_of(mem: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The tutorial's loss: cross-entropy of the output membrane at every step."""
    return sum(nn.functional.cross_entropy(m, targets) for m in mem)  # type: ignore[return-value]


def main() -> None:
    torch.set_num_threads(1)  # small steps: one thread is fastest, also on a busy machine
    img = torch.rand(BATCH, NUM_INPUTS)  # stands in for a batch of flattened MNIST digits
    targets = torch.randint(0, NUM_OUTPUTS, (BATCH,))

    net = build()
    seq = spikeckpt.wrap(net, granularity="layer")
    x = img.expand(NUM_STEPS, *img.shape)  # (T, B, 784): a view, the image at every step

    def loop_step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        net.zero_grad()
        spk, mem = tutorial_loop(net, img)
        loss_of(mem, targets).backward()
        return spk.detach(), [p.grad.clone() for p in net.parameters()]

    def wrapped_step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        net.zero_grad()
        spk, mem = seq(x)  # what the loop stacks: (T, B, 10) spikes and membranes
        loss_of(mem, targets).backward()
        return spk.detach(), [p.grad.clone() for p in net.parameters()]

    runs = {"tutorial loop": loop_step, "wrapped, layer-wise": wrapped_step}
    results = {name: run() for name, run in runs.items()}  # first calls: checks, planning
    seconds = dict.fromkeys(runs, float("inf"))
    for _ in range(3):  # the least of three interleaved rounds
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name] = min(seconds[name], time.perf_counter() - start)
    peaks = {}
    for name, run in runs.items():
        with spikeckpt.MemoryMeter() as meter:
            run()
        peaks[name] = meter.peak_bytes

    (spk_a, grads_a), (spk_b, grads_b) = results.values()
    diff = max(float((a - b).abs().max()) for a, b in zip(grads_a, grads_b, strict=True))
    print(f"tutorial 5: {NUM_INPUTS}-{NUM_HIDDEN}-{NUM_OUTPUTS}, {NUM_STEPS} steps, batch {BATCH}")
    for name in runs:
        ratio = seconds[name] / seconds["tutorial loop"]
        print(
            f"  {name}: {seconds[name]:.3f} s ({ratio:.2f}x the loop), "
            f"peak {spikeckpt.format_bytes(peaks[name])}"
        )
    print(f"  {seq.last_stats.plan}, neurons: {[b.neuron for b in seq.last_stats.blocks]}")
    print(f"output spikes equal to the loop's: {torch.equal(spk_a, spk_b)}")
    print(f"max gradient difference: {diff:.3g}")


if __name__ == "__main__":
    main()
