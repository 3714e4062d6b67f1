"""When a ``Linear`` over spikes should gather: the measured break-even behind the library's rule.

Layer-wise on the CPU, a block whose synapse is one plain ``nn.Linear`` may compute a chunk's
``x @ W.T`` by gathering the weight's columns at the input's non-zeros (``embedding_bag``) and
its weight gradient ``grad.T @ x`` by gathering ``grad``'s rows, instead of the dense products.
Per chunk a layer-wise training step runs the synapse twice (the forward pass and the
recomputation: each lists the non-zeros, then gathers) and its weight gradient once. This
script times both ways for one chunk of ``--rows`` rows, over widths and densities, and prints
the dense way's time over the gather's (above 1: the gather is faster) next to the share
`spikeckpt.adapters.affine.sparse_share` gathers up to, so the rule can be checked against a
machine:

    taskset -c 1 python benchmarks/bench_gather.py --threads 1
    python benchmarks/bench_gather.py --threads 2

Each time is the minimum of ``--repeats`` runs (the machine is shared: the minimum is the
least disturbed). A row's ``rule`` column is the share the library gathers up to at these
threads; the ratios at densities at or below it should be above 1, those above it below.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from spikeckpt.adapters.affine import sparse_share, weight_positions
from spikeckpt.adapters.gather import gather, gather_weight_grad

#: ``(inputs, outputs)`` of the Linear layers timed
WIDTHS = ((256, 64), (256, 128), (256, 256), (784, 512), (784, 1000), (2048, 512))
DENSITIES = (0.03, 0.0625, 0.1, 0.15, 0.2, 0.3)


class _EveryShare:
    """A gather limit that lists any share of non-zeros (the benchmark times both ways)."""

    def share(self, out_features: int) -> float:
        return 1.0


_EVERY_SHARE = _EveryShare()


def best(run: Callable[[], object], repeats: int) -> float:
    """The least of ``repeats`` wall times of ``run()`` (seconds)."""
    least = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        least = min(least, time.perf_counter() - start)
    return least


def chunk_ratio(rows: int, n_in: int, n_out: int, density: float, repeats: int) -> float:
    """The dense way's time over the gather's for one chunk: two synapse passes (listing the
    non-zeros and gathering each time) and one weight gradient."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(n_out, n_in, generator=generator)
    bias = torch.randn(n_out, generator=generator)
    grad = torch.randn(rows, n_out, generator=generator)
    x = (torch.rand(rows, n_in, generator=generator) < density).float()
    kept = weight.t().contiguous() if weight.numel() <= 1 << 18 else None

    def listed() -> tuple[torch.Tensor, torch.Tensor]:
        """The library's listing of the chunk's non-zeros (`affine.weight_positions`)."""
        found = weight_positions(x, weight, _EVERY_SHARE)  # type: ignore[arg-type]
        assert found is not None
        return found[1], found[2]

    r, c = listed()
    target = torch.zeros(n_out, n_in)
    dense_pass = best(lambda: torch.addmm(bias, x, weight.t()), repeats)
    dense_grad = best(lambda: grad.t() @ x, repeats)
    gather_pass = best(lambda: gather(weight, rows, *listed(), None, kept), repeats)
    gather_grad = best(lambda: gather_weight_grad(grad, r, c, None, (n_out, n_in), target), repeats)
    return (2 * dense_pass + dense_grad) / (2 * gather_pass + gather_grad)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=400, help="rows of a chunk (steps x batch)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.rows} rows per chunk: "
        "dense time / gather time for one chunk's two passes and weight gradient"
    )
    header = " | ".join(f"{d:.3g}" for d in DENSITIES)
    print(f"| Linear | rule | {header} |")
    print("|---|---|" + "---|" * len(DENSITIES))
    for n_in, n_out in WIDTHS:
        ratios = [chunk_ratio(args.rows, n_in, n_out, d, args.repeats) for d in DENSITIES]
        cells = " | ".join(f"{r:.2f}" for r in ratios)
        share = sparse_share(n_out, args.threads)
        print(f"| {n_in} -> {n_out} | {share:.3f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
