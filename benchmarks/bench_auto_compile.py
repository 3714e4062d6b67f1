"""``compile="auto"`` against ``False`` and ``True`` over a training run (stack granularity).

A run of ``--calls`` training steps (forward, backward, SGD) of one model at one shape, once per
``compile`` setting in one process (dynamo reset between them; inductor's disk cache as it is:
the first setting that compiles may pay a cold compile, later ones a warm one). Printed per
setting: the whole run's time, the mean of its last 10 calls, and the calls that ran compiled.
``"auto"`` runs eagerly until a shape's calls took `COMPILE_AFTER_SECONDS`, then compiles and
keeps the compiled step where faster (`spikeckpt.engine.auto_compile`).

    taskset -c 1 python benchmarks/bench_auto_compile.py --threads 1
    python benchmarks/bench_auto_compile.py --model overhead --calls 60
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import snntorch as snn
import torch
from torch import nn

import spikeckpt as sc
from spikeckpt.engine import auto_compile

MODELS = {  # name: (layer widths, batch, T)
    "lif": ((200, 256, 10), 16, 300),
    "overhead": ((8, 8, 8, 8), 1, 2000),
}


def network(widths: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), snn.Leaky(beta=0.9)]
    return nn.Sequential(*layers)


def run(mode: Any, widths: tuple[int, ...], x: torch.Tensor, calls: int) -> dict[str, Any]:
    """``calls`` SGD steps of a fresh model (seed 0) wrapped with ``compile=mode``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = network(widths)
    seq = sc.wrap(net, plan=sc.plans.BPTT(), readout="sum", compile=mode)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    times, compiled = [], 0
    for _ in range(calls):
        started = time.perf_counter()
        optimizer.zero_grad()
        seq(x).square().sum().backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
        compiled += seq.last_stats.step_compiled
    weights = torch.cat([p.detach().flatten() for p in net.parameters()])
    return {"total": sum(times), "last": sum(times[-10:]) / 10, "compiled": compiled, "w": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="lif")
    parser.add_argument("--calls", type=int, default=120)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--after", type=float, default=auto_compile.COMPILE_AFTER_SECONDS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    auto_compile.COMPILE_AFTER_SECONDS = args.after
    widths, batch, T = MODELS[args.model]
    torch.manual_seed(1)
    x = (torch.rand(T, batch, widths[0]) < 0.05).float()
    print(f"{args.model}: widths {widths}, batch {batch}, T = {T}, {args.calls} SGD steps, BPTT()")
    print(f"threads {args.threads}, torch {torch.__version__}, auto after {args.after} s")
    rows = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in (False, "auto", True):
            rows[mode] = run(mode, widths, x, args.calls)
    base = rows[False]
    for mode, row in rows.items():
        gap = float((row["w"] - base["w"]).abs().max())
        print(
            f"compile={mode!s:5}: run {row['total']:7.2f} s ({row['total'] / base['total']:.2f}x"
            f" eager), last 10 calls {row['last'] * 1e3:7.1f} ms each, {row['compiled']:3d} calls"
            f" compiled, weights max |diff| vs eager {gap:.1e}"
        )


if __name__ == "__main__":
    main()
