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


def table(T: int, state_bytes: int = 1, step_bytes: int = 1) -> list[tuple[str, plans.Cost]]:
    """Rows (plan, cost) for ``T`` steps at 5% of BPTT's device memory."""
    bptt = plans.BPTT()
    rows = [(repr(bptt), bptt.cost(T, state_bytes=state_bytes, step_bytes=step_bytes, costs=COSTS))]
    budget = (state_bytes + T * step_bytes) // 20
    for candidate in plans.rank(T, state_bytes, step_bytes, budget, costs=COSTS):
        rows.append((repr(candidate.plan), candidate.cost))
    return rows


def main() -> None:
    for T in (1_000, 10_000):
        budget = (1 + T) // 20
        print(f"\nT = {T:,} steps, budget = {budget:,} states (5% of BPTT), S = A = 1")
        print(f"{'plan':<48} {'evals':>8} {'per step':>8} {'peak':>6} {'remote':>7} {'time':>6}")
        for name, cost in table(T):
            print(
                f"{name[:48]:<48} {cost.forward_steps:>8,} {cost.recompute_factor:>8.2f} "
                f"{cost.peak_bytes:>6,} {cost.remote_writes + cost.remote_reads:>7,} "
                f"{cost.time_factor(COSTS):>6.2f}"
            )


if __name__ == "__main__":
    main()
