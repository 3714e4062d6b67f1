"""``spikeckpt data synth``: write synthetic SHD / N-MNIST files in the real formats."""

from __future__ import annotations

import argparse
from typing import Any

from spikeckpt.cli._args import non_negative_int, output_folder, positive_int

#: How to use the files each dataset's writer leaves, printed after writing them.
_USE = {
    "shd": "SHDDataModule(root={root!r}), tonic.datasets.SHD(save_to={root!r}) or "
    "spikeckpt demo --root {root}",
    "nmnist": "NMNISTDataModule(root={root!r}) or spikeckpt.data.NMNIST(save_to={root!r})",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``spikeckpt data synth``."""
    data = subparsers.add_parser(
        "data",
        help="datasets: write synthetic SHD / N-MNIST files",
        description=(
            "Datasets for long-sequence training. 'data synth' writes synthetic recordings\n"
            "in the real on-disk formats of SHD and N-MNIST, for trying things out offline."
        ),
    )
    commands = data.add_subparsers(dest="data_command", metavar="COMMAND", required=True)
    synth = commands.add_parser(
        "synth",
        help="write synthetic SHD or N-MNIST files that tonic reads like the real ones",
        description=(
            "Write synthetic files in the real on-disk format under ROOT/SHD or ROOT/NMNIST,\n"
            "where tonic (and SHDDataModule / NMNISTDataModule with root=ROOT) look for them.\n"
            "Refuses to overwrite real data."
        ),
        epilog="example:\n  spikeckpt data synth --dataset shd --root data --samples 512",
    )
    synth.add_argument(
        "--dataset", choices=("shd", "nmnist"), required=True, help="which data set to imitate"
    )
    synth.add_argument(
        "--root",
        type=output_folder,
        required=True,
        help="tonic's save_to folder (files go below it; created if missing)",
    )
    synth.add_argument(
        "--samples",
        type=positive_int,
        default=None,
        help="training recordings (default: 256 for shd, 200 for nmnist)",
    )
    synth.add_argument(
        "--test-samples",
        type=positive_int,
        default=None,
        help="test recordings (default: samples/4)",
    )
    synth.add_argument(
        "--seed", type=non_negative_int, default=0, help="random seed (an integer >= 0)"
    )
    synth.add_argument(
        "--include-empty", action="store_true", help="make sample 0 of each split empty"
    )
    synth.set_defaults(handler=run_synth)


def run_synth(args: argparse.Namespace) -> int:
    """Handler of ``data synth``: write the files, print where they are and how to use them."""
    from spikeckpt.data.synthetic import write_synthetic_nmnist, write_synthetic_shd

    writer = write_synthetic_shd if args.dataset == "shd" else write_synthetic_nmnist
    kwargs: dict[str, Any] = {"seed": args.seed, "include_empty": args.include_empty}
    if args.samples is not None:
        kwargs["samples"] = args.samples
    if args.test_samples is not None:
        kwargs["test_samples"] = args.test_samples
    where = writer(args.root, **kwargs)
    print(f"wrote synthetic {args.dataset} files to {where}")
    print("use them with " + _USE[args.dataset].format(root=str(args.root)))
    return 0
