"""Compare the checkpointing plans on the simulator: no tensors, no torch, instant.

Prints, for T = 1,000 and 10,000 steps and a device budget of 5% of plain BPTT's memory
(one state S = one taped step A), each plan family's best member that fits, with its step
evaluations, peak device memory (in units of S) and remote transfers.

    python examples/plan_table.py
"""

from __future__ import annotations

from spikeckpt import plans
from spikeckpt.plans import CostModel

#: A remote write or read costs as much as two step evaluations in this illustration.
COSTS = CostModel(forward=1.0, backward=2.0, write=2.0, read=2.0)


def table(
    T: int, state_bytes: int = 1, step_bytes: int = 1
) -> tuple[list[tuple[str, plans.Cost]], list[str]]:
    """Rows (plan, cost) for ``T`` steps at 5% of BPTT's device memory, and notes: a family
    whose best plan is another family's (a Double without a remote checkpoint is a Uniform,
    ``Plan.as_run``) gets a note instead of a row."""
    bptt = plans.BPTT()
    rows = [(repr(bptt), bptt.cost(T, state_bytes=state_bytes, step_bytes=step_bytes, costs=COSTS))]
    notes = []
    budget = (state_bytes + T * step_bytes) // 20
    for candidate in plans.rank(T, state_bytes, step_bytes, budget, costs=COSTS):
        plan, ran = candidate.plan, candidate.plan.as_run(T)
        if type(ran) is type(plan):
            rows.append((repr(plan), candidate.cost))
        else:
            notes.append(f"{plan!r} keeps no remote checkpoint at this T: it is {ran!r}")
    return rows, notes


def main() -> None:
    for T in (1_000, 10_000):
        budget = (1 + T) // 20
        rows, notes = table(T)
        width = max(len(name) for name, _ in rows)  # whole plan names, never cut
        print(f"\nT = {T:,} steps, budget = {budget:,} states (5% of BPTT), S = A = 1")
        print(
            f"{'plan':<{width}} {'evals':>8} {'per step':>8} {'peak':>6} {'remote':>7} {'time':>6}"
        )
        for name, cost in rows:
            print(
                f"{name:<{width}} {cost.forward_steps:>8,} {cost.recompute_factor:>8.2f} "
                f"{cost.peak_bytes:>6,} {cost.remote_writes + cost.remote_reads:>7,} "
                f"{cost.time_factor(COSTS):>6.2f}"
            )
        for note in notes:
            print(f"({note})")


if __name__ == "__main__":
    main()
