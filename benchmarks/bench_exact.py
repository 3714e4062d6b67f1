"""How exact is layer-wise on this device: spikes and gradients against the snnTorch loop.

The layer-wise granularity multiplies a chunk's inputs by a synapse's weight in one product
over ``k x B`` rows (and, on the CPU, gathers the first block's weight columns over the input's
ones), where the plain loop makes ``k`` products of ``B`` rows. Where the BLAS sums the two
shapes in another order (cuBLAS does; so did the CPU of an H200 machine; this project's 2-core
development VM does not), membranes differ at round-off and a membrane within round-off of the
threshold spikes on the other side: the spikes, and with them the gradients, leave the loop's.
``wrap(..., exact=True)`` runs every synapse step by step, as the loop does.

Printed, in one process: (1) for ``Linear(200, 256)`` and ``Linear(256, 10)``, how many outputs
of one product over ``k`` steps differ from ``k`` per-step products (``k`` = 25, 100, 1000);
(2) a table: the snnTorch loop (200-256-10 ``Linear`` + ``snn.Leaky``, batch 16, ``T`` steps,
5% input spikes, loss on the output firing rate) against ``spikeckpt.wrap`` with the stack
``BPTT()`` plan, layer-wise (chunk 25) by default, with ``exact=True``, and with ``fuse=False``:
output spikes that differ from the loop's, the largest relative gradient difference, and the
time of one forward + backward (minimum of ``--repeats`` interleaved rounds, after one
untimed).

    python benchmarks/bench_exact.py                  # the CPU
    python benchmarks/bench_exact.py --device cuda    # a GPU (step 6 of gpu_suite.sh)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.models import spike_train

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_table import lif_stack, snntorch_model  # noqa: E402


def products_differ(device: torch.device) -> list[str]:
    """Lines: how many outputs of one product over ``k`` steps differ from ``k`` products."""
    torch.manual_seed(0)
    lines = []
    for n_in, n_out, density in ((200, 256, 0.05), (256, 10, 0.1)):
        linear = nn.Linear(n_in, n_out).to(device)
        x = (torch.rand(1000, 16, n_in, device=device) < density).float()
        with torch.no_grad():
            for k in (25, 100, 1000):
                whole = linear(x[:k].reshape(k * 16, n_in)).reshape(k, 16, n_out)
                steps = torch.stack([linear(x_t) for x_t in x[:k]])
                differ = int((whole != steps).sum())
                worst = float((whole - steps).abs().max())
                lines.append(
                    f"Linear({n_in}, {n_out}), {k} steps of batch 16: {differ} of "
                    f"{whole.numel()} outputs differ (largest {worst:.1e})"
                )
    return lines


def loop_run(net: nn.Sequential, x: Tensor) -> Tensor:
    """The snnTorch loop: output spikes ``(T, B, n)``; the loss's gradients into ``.grad``."""
    layers = list(net)
    mems: list[Tensor | None] = [None] * (len(layers) // 2)
    outs = []
    for x_t in x:
        h = x_t
        for i in range(0, len(layers), 2):
            mem = mems[i // 2]
            if mem is None:
                mem = torch.zeros(x.shape[1], layers[i].out_features, device=x.device)
            h, mems[i // 2] = layers[i + 1](layers[i](h), mem)
        outs.append(h)
    y = torch.stack(outs)
    loss(y).backward()
    for neuron in layers[1::2]:  # snnTorch keeps the last membrane (and the graph) on the module
        if isinstance(getattr(neuron, "mem", None), Tensor):
            neuron.mem = neuron.mem.detach()
    return y.detach()


def loss(y: Tensor) -> Tensor:
    return (y.mean(0) - 0.1).square().mean()


def rows(net: nn.Sequential) -> dict[str, Callable[[Tensor], Tensor]]:
    """The runs compared with the loop: name -> ``run(x) -> output spikes``."""
    options: dict[str, dict[str, Any]] = {
        "stack, BPTT()": {"plan": sc.plans.BPTT()},
        "layer-wise, chunk 25": {"granularity": "layer", "chunk": 25},
        "layer-wise, chunk 25, exact=True": {"granularity": "layer", "chunk": 25, "exact": True},
        "layer-wise, chunk 25, fuse=False": {"granularity": "layer", "chunk": 25, "fuse": False},
    }
    out = {"snnTorch loop": lambda x: loop_run(net, x)}
    for name, kwargs in options.items():
        wrapped = sc.wrap(net, **kwargs)

        def run(x: Tensor, wrapped: nn.Module = wrapped) -> Tensor:
            y = wrapped(x)
            loss(y).backward()
            return y.detach()

        out[name] = run
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--T", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="timed interleaved rounds (min)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "the CPU"
    print(f"device {args.device} ({name}), torch {torch.__version__}, {args.threads} thread(s)")
    for line in products_differ(device):
        print(line)
    net = snntorch_model(lif_stack([200, 256, 10]))
    if net is None:
        sys.exit("bench_exact.py needs snnTorch")
    net = net.to(device)
    x = spike_train(args.T, 16, 200, 0.05, seed=1).to(device)
    runs = rows(net)
    results: dict[str, tuple[Tensor, list[Tensor]]] = {}
    for row, run in runs.items():  # untimed first call: plans, probes, checks kernels
        net.zero_grad()
        y = run(x)
        results[row] = (y, [p.grad.clone() for p in net.parameters()])  # type: ignore[union-attr]
    times: dict[str, float] = dict.fromkeys(runs, float("inf"))
    for _ in range(args.repeats):
        for row, run in runs.items():
            net.zero_grad()
            gc.collect()
            sync()
            start = time.perf_counter()
            run(x)
            sync()
            times[row] = min(times[row], time.perf_counter() - start)
    y0, g0 = results["snnTorch loop"]
    print(f"\nT = {args.T}, batch 16, 200-256-10; the loop's output spikes: {int(y0.sum())}\n")
    print("| run | output spikes differing | max rel dW | time | x loop |")
    print("|---|---|---|---|---|")
    for row, (y, grads) in results.items():
        differ = int((y != y0).sum())
        rel = max(
            float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads, g0, strict=True)
        )
        ratio = times[row] / times["snnTorch loop"]
        print(f"| {row} | {differ} | {rel:.1e} | {times[row]:.3g} s | {ratio:.2f} |")


if __name__ == "__main__":
    main()
