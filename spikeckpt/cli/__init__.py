"""The ``spikeckpt`` command line: ``demo``, ``plan``, ``bench``, ``data``.

The top layer of the package: nothing else in spikeckpt imports it. Each subcommand lives in
its own module here (``demo``, ``plan``, ``bench``, ``data``) with ``add_parser(subparsers)``;
building the parser imports neither torch nor any optional extra, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

from spikeckpt.cli import bench, data, demo, plan
from spikeckpt.cli._args import Parser
from spikeckpt.cli._interrupt import EXIT_INTERRUPTED, Interrupts
from spikeckpt.errors import SpikeckptError

__all__ = ["build_parser", "main"]

_EXAMPLES = """\
examples:
  spikeckpt demo                  train on synthetic SHD in a budget (2-3 min)
  spikeckpt demo --root ~/data    the same on the real SHD files in ~/data/SHD
  spikeckpt plan --T 4000 --budget 5% --model 700,256,256,20
  spikeckpt bench --quick         every strategy at tiny sizes (about 15 s)
  spikeckpt data synth --dataset shd --root data

'spikeckpt COMMAND --help' explains a command; docs/cli.md all of them.
"""


def _version() -> str:
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:  # pragma: no cover - torch is a dependency
        torch = "not installed"
    from spikeckpt import __version__

    return f"spikeckpt {__version__} (Python {platform.python_version()}, torch {torch})"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = Parser(
        prog="spikeckpt",
        description=(
            "Train spiking networks on long sequences with checkpointed memory and exact\n"
            "gradients."
        ),
        epilog=_EXAMPLES,
    )
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (demo, plan, bench, data):
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``spikeckpt`` script; returns the exit status.

    0: success; 2: a usage error or a failure with a message saying what to change; 3: no
    plan fits the budget (``plan``, ``demo``); 130: interrupted (Ctrl-C), with one line
    ``spikeckpt COMMAND: interrupted`` and temporary files removed.
    """
    interrupts = Interrupts()
    interrupts.install()
    command = "spikeckpt"
    try:
        parser = build_parser()
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        command = f"spikeckpt {args.command}"
        if getattr(args, "data_command", None):
            command += f" {args.data_command}"
        return _run(args, command)
    except KeyboardInterrupt:
        return _interrupted(command)
    except SystemExit:
        if interrupts.received:  # a library ended the run after catching Ctrl-C (Lightning)
            return _interrupted(command)
        raise
    finally:
        interrupts.restore()


def _interrupted(command: str) -> int:
    """Say so in one line (after showing the cursor a live display may have hidden)."""
    if sys.stdout.isatty():
        sys.stdout.write("\x1b[?25h")
        sys.stdout.flush()
    print(f"{command}: interrupted", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def _run(args: argparse.Namespace, command: str) -> int:
    handler: Callable[[argparse.Namespace], int | None] = args.handler
    try:
        return handler(args) or 0
    except ModuleNotFoundError as error:
        if (error.name or "spikeckpt").startswith("spikeckpt"):
            raise  # our own module: a bug, not a missing extra
        extra = _EXTRAS.get(error.name or "", "all")
        print(
            f'{command}: error: needs the package {error.name!r}: pip install "spikeckpt[{extra}]"',
            file=sys.stderr,
        )
        return 2
    except (SpikeckptError, ValueError, OSError) as error:
        print(f"{command}: error: {error}", file=sys.stderr)
        return 2


#: Optional package -> the extra that installs it.
_EXTRAS = {
    "snntorch": "snntorch",
    "norse": "norse",
    "tonic": "tonic",
    "h5py": "tonic",
    "lightning": "lightning",
}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
