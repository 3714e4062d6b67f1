"""``spikeckpt plan``: print the plan chosen for a sequence length and device budget."""

from __future__ import annotations

import argparse
import itertools
import re
from typing import cast

from spikeckpt.cli._args import budget, byte_size, positive_int
from spikeckpt.errors import ConfigError


def _widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",")]
    except ValueError:
        widths = []
    if len(widths) < 2 or any(w < 1 for w in widths):
        raise argparse.ArgumentTypeError(
            f"cannot parse {text!r} as layer widths: write two or more positive integers "
            "separated by commas, e.g. 700,512,512,20"
        )
    return widths


def _cost(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(
            f"must be a time >= 0 in units of one forward step, got {text!r}"
        )
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``spikeckpt plan``."""
    parser = subparsers.add_parser(
        "plan",
        help="choose a checkpointing plan for a length and a device budget, without training",
        description=(
            "Print the plan with the least modeled time that fits the device budget, its\n"
            "modeled device and remote bytes and time factor, and the best plan of every\n"
            "other family. Sizes come from --state-bytes and --step-bytes, or are measured\n"
            "on a LIF network with --model."
        ),
        epilog=(
            "examples:\n"
            "  spikeckpt plan --T 1000 --budget 1MiB --state-bytes 64KiB --step-bytes 100KiB\n"
            "  spikeckpt plan --T 4000 --budget 5% --model 700,256,256,20 --batch 32"
        ),
    )
    parser.add_argument(
        "--T", type=positive_int, required=True, metavar="STEPS", help="sequence length in steps"
    )
    parser.add_argument(
        "--budget",
        type=budget,
        required=True,
        metavar="BUDGET",
        help=(
            "device bytes for the plan's checkpoints and tapes alone (wrap(budget=) and "
            "MemoryBudget count the whole training step, so the same number buys less "
            "there): bytes (1GiB, 500MB) or a share of plain BPTT's need (5%%)"
        ),
    )
    parser.add_argument(
        "--state-bytes", type=byte_size, metavar="BYTES", help="S: bytes of one state (64KiB)"
    )
    parser.add_argument(
        "--step-bytes", type=byte_size, metavar="BYTES", help="A: bytes taped per step (100KiB)"
    )
    parser.add_argument(
        "--model",
        type=_widths,
        metavar="WIDTHS",
        help="layer widths of a LIF network, e.g. 700,512,512,20: measures S and A with torch",
    )
    parser.add_argument(
        "--batch", type=positive_int, default=32, metavar="B", help="batch size for --model"
    )
    parser.add_argument(
        "--no-remote", action="store_true", help="device-only plans (no Double, no TwoLevel)"
    )
    parser.add_argument(
        "--write-cost",
        type=_cost,
        default=0.0,
        metavar="STEPS",
        help="one remote write, in forward steps",
    )
    parser.add_argument(
        "--read-cost",
        type=_cost,
        default=0.0,
        metavar="STEPS",
        help="one remote read, in forward steps",
    )
    parser.set_defaults(handler=run)


def _sizes(args: argparse.Namespace) -> tuple[int, int]:
    if args.model:
        if args.state_bytes is not None or args.step_bytes is not None:
            raise ConfigError("give either --model or --state-bytes/--step-bytes, not both")
        return _measured_sizes(args.model, args.batch)
    if args.state_bytes is None or args.step_bytes is None:
        raise ConfigError(
            "give --model WIDTHS (with --batch), or both --state-bytes and --step-bytes"
        )
    return args.state_bytes, args.step_bytes


def _measured_sizes(widths: list[int], batch: int) -> tuple[int, int]:
    """``(S, A)`` of a LIF stack measured with torch. A network too large to build here is a
    one-line ValueError naming what it needs and what to do instead, before torch tries
    (a weight matrix that does not fit would otherwise end in an allocation failure, or
    worse, in swapping)."""
    from spikeckpt.units import available_host_bytes, format_bytes

    weights = 4 * sum(a * b + b for a, b in itertools.pairwise(widths))  # float32, with biases
    needed = 2 * weights  # the weights and their gradients, while one step is measured
    available = available_host_bytes()

    def too_large(what: str) -> ConfigError:
        return ConfigError(
            f"--model {','.join(map(str, widths))}: measuring it builds the network, whose "
            f"weights alone take {format_bytes(weights)}; {what}: give --state-bytes and "
            "--step-bytes instead (S: bytes of one state; A: bytes taped per step), or smaller "
            "widths"
        )

    if needed > available:
        raise too_large(
            f"with their gradients {format_bytes(needed)}, more than the "
            f"{format_bytes(available)} this machine has available"
        )
    from spikeckpt.models import lif_stack_sizes  # torch only when asked

    try:
        return lif_stack_sizes(widths, batch=batch)
    except (RuntimeError, MemoryError) as error:
        if isinstance(error, RuntimeError) and "alloc" not in str(error).lower():
            raise
        tried = re.search(r"allocate (\d+) bytes", str(error))
        size = f" of {format_bytes(int(tried.group(1)))}" if tried else ""
        raise too_large(f"an allocation{size} failed on this machine") from None


def run(args: argparse.Namespace) -> int:
    """Print the chosen plan and the alternatives; exit 3 when nothing fits."""
    from spikeckpt import plans
    from spikeckpt.errors import BudgetTooSmall
    from spikeckpt.units import format_bytes

    S, A = _sizes(args)
    bptt = S + args.T * A
    budget_bytes = args.budget.resolve(bptt)
    costs = plans.CostModel(write=args.write_cost, read=args.read_cost)
    remote = not args.no_remote
    sizes = plans.StepSizes(state=S, tape=A)  # the one account; nothing beside the plan here
    try:
        chosen = plans.choose_step(args.T, sizes, budget_bytes, remote=remote, costs=costs).plan
    except BudgetTooSmall as error:
        print(f"no plan fits: {error}")
        return 3
    ranked = plans.rank_steps(args.T, sizes, budget_bytes, remote=remote, costs=costs)
    share = f" ({args.budget} of BPTT's {format_bytes(bptt)})" if args.budget.share else ""
    transfers = (
        f"; a remote write costs {args.write_cost:g}, a read {args.read_cost:g} forward steps"
        if remote
        else "; device-only plans"
    )
    print(
        f"T={args.T} steps, budget {format_bytes(budget_bytes)}{share}, S={format_bytes(S)}, "
        f"A={format_bytes(A)}{transfers}"
    )
    print(f"chosen: {chosen!r}")
    # a Double whose remote interval covers T keeps no remote checkpoint: it is a Uniform
    # (rank_steps ranks plans, never a Schedule)
    plain = [
        c for c in ranked if type(cast("plans.Plan", c.plan).as_run(args.T)) is not type(c.plan)
    ]
    ranked = [c for c in ranked if c not in plain]
    names = [repr(candidate.plan) for candidate in ranked]
    width = max(len("plan"), *map(len, names))
    print(f"{'plan':<{width}} {'device':>10} {'remote':>10} {'evals/step':>10} {'time/BPTT':>10}")
    for name, candidate in zip(names, ranked, strict=True):
        cost = candidate.cost
        remote_bytes = cost.peak_remote_states * S
        print(
            f"{name:<{width}} {format_bytes(cost.peak_bytes):>10} "
            f"{format_bytes(remote_bytes):>10} {cost.recompute_factor:>10.2f} "
            f"{cost.time_factor(costs):>10.2f}"
        )
    for candidate in plain:
        family = type(candidate.plan).__name__
        print(
            f"{family}: the fastest that fits, {candidate.plan!r}, keeps no remote checkpoint "
            f"at T={args.T}: it is {cast('plans.Plan', candidate.plan).as_run(args.T)!r}"
        )
    return 0
