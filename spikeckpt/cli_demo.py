"""``spikeckpt demo``: the main job (needs ``spikeckpt[all]``)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``spikeckpt demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="train an SNN on SHD within a device memory budget and compare with plain BPTT",
        description=(
            "Train a 700-H-H-20 LIF network on SHD (the real files under --root when present, "
            "synthetic files in the real format otherwise) with Lightning and MemoryBudget, "
            "then compare one training step under plain BPTT and under the chosen plan."
        ),
    )
    parser.add_argument("--root", default="data", help="tonic save_to folder (default: data)")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs (default 2)")
    parser.add_argument(
        "--budget", default=None, help="device budget, e.g. 64MiB (default: 1/4 of BPTT's need)"
    )
    parser.add_argument("--dt-us", type=int, default=1000, help="time bin in us (default 1000)")
    parser.add_argument("--framework", choices=("snntorch", "norse"), default="snntorch")
    parser.add_argument("--device", default="cpu", help="Lightning accelerator (cpu, gpu)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden width (default 128)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=256, help="synthetic training samples")
    parser.add_argument("--out", default="spikeckpt-out", help="folder for the plot")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit 3 when the budget is too small."""
    from spikeckpt.demo import run as run_demo
    from spikeckpt.errors import BudgetTooSmall
    from spikeckpt.units import parse_bytes

    budget = parse_bytes(args.budget) if args.budget is not None else None
    if args.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {args.epochs}")
    try:
        run_demo(
            args.root,
            epochs=args.epochs,
            budget=budget,
            dt_us=args.dt_us,
            framework=args.framework,
            device=args.device,
            hidden=args.hidden,
            batch_size=args.batch_size,
            samples=args.samples,
            out=args.out,
            progress=not args.no_progress,
        )
    except BudgetTooSmall as error:
        print(f"spikeckpt demo: {error}")
        return 3
    return 0
