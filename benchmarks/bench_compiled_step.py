"""The stack granularity's step eager and compiled (``compile=True``), on small models of
several kinds: snnTorch Leaky, Synaptic and RLeaky, Norse LIFCell, a convolutional net.

Each model runs ``BPTT()`` over T = 300 steps at batch 2, eager and compiled, in one process:
time is the minimum of interleaved rounds after two calls of each (the compiled step compiles
in both: the first call's later steps, the second call's first step, whose state has no
gradient yet), and the outputs and gradients of the two are compared. Dynamo's graph breaks are counted over the compiled
calls (0: the whole step ran as one compiled graph).

    taskset -c 1 python benchmarks/bench_compiled_step.py --threads 1
    python benchmarks/bench_compiled_step.py --device cuda   # Triton; in gpu_suite.sh
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable, Iterator

import snntorch as snn
import torch
from torch import Tensor, nn
from torch._dynamo.utils import counters

import spikeckpt as sc

try:
    import norse.torch as norse
except ImportError:  # pragma: no cover - norse is an extra
    norse = None


def models() -> Iterator[tuple[str, nn.Module, tuple[int, ...]]]:
    """(name, model, one step's input shape without the batch)."""
    yield (
        "snnTorch Leaky, 2 x 8",
        nn.Sequential(nn.Linear(8, 8), snn.Leaky(0.9), nn.Linear(8, 8), snn.Leaky(0.9)),
        (8,),
    )
    yield (
        "snnTorch Synaptic, 2 x 8",
        nn.Sequential(
            nn.Linear(8, 8),
            snn.Synaptic(alpha=0.8, beta=0.9),
            nn.Linear(8, 8),
            snn.Synaptic(alpha=0.8, beta=0.9),
        ),
        (8,),
    )
    yield (
        "snnTorch RLeaky, 8",
        nn.Sequential(nn.Linear(8, 8), snn.RLeaky(beta=0.9, linear_features=8)),
        (8,),
    )
    if norse is not None:
        yield (
            "Norse LIFCell, 2 x 8",
            nn.Sequential(nn.Linear(8, 8), norse.LIFCell(), nn.Linear(8, 8), norse.LIFCell()),
            (8,),
        )
    yield (
        "Conv2d(1, 4, 3) + Leaky, Linear + Leaky",
        nn.Sequential(
            nn.Conv2d(1, 4, 3),
            snn.Leaky(0.9),
            nn.Flatten(),
            nn.Linear(4 * 6 * 6, 5),
            snn.Leaky(0.9),
        ),
        (1, 8, 8),
    )


def _sync(x: Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def one_step(seq: nn.Module, net: nn.Module, x: Tensor) -> tuple[float, Tensor, list[Tensor]]:
    """Seconds of one forward + backward (loss: the outputs' sum), the output, the grads."""
    net.zero_grad(set_to_none=True)
    _sync(x)
    start = time.perf_counter()
    out = seq(x)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    _sync(x)
    seconds = time.perf_counter() - start
    return seconds, out.detach(), [p.grad.clone() for p in net.parameters() if p.grad is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=300)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--breaks", action="store_true", help="print dynamo's reasons for each graph break"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    print(f"BPTT(), T = {args.T}, batch {args.batch}, {device}, {args.threads} thread(s)")
    print(
        "| model | eager | compiled | x eager | first two compiled calls | graph breaks | outputs "
        "| max rel dgrad |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, net, shape in models():
        torch.manual_seed(0)
        net = net.to(device)
        x = (torch.rand(args.T, args.batch, *shape) < 0.3).float().to(device)
        seqs = {c: sc.wrap(net, compile=c, plan=sc.plans.BPTT()) for c in (False, True)}
        counters.clear()
        start = time.perf_counter()
        got = one_step(seqs[True], net, x)
        one_step(seqs[True], net, x)
        first = time.perf_counter() - start
        one_step(seqs[False], net, x)
        want = one_step(seqs[False], net, x)
        runs: dict[bool, Callable[[], float]] = {
            c: (lambda s=s, net=net, x=x: one_step(s, net, x)[0]) for c, s in seqs.items()
        }
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.rounds):
            for c, run in runs.items():
                best[c] = min(best[c], run())
        breaks = sum(counters["graph_break"].values())
        reasons = dict(counters["graph_break"])
        rel = max(
            float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
            for a, b in zip(want[2], got[2], strict=True)
        )
        same = "bitwise" if torch.equal(want[1], got[1]) else "differ"
        ran = "" if seqs[True].last_stats.step_compiled else " (ran eagerly)"
        print(
            f"| {name} | {best[False]:.3f} s | {best[True]:.3f} s{ran} | "
            f"{best[True] / best[False]:.2f} | {first:.1f} s | {breaks} | {same} | {rel:.1e} |"
        )
        if args.breaks:
            for reason, count in reasons.items():
                print(f"  break x{count}: {reason}")


if __name__ == "__main__":
    main()
