"""Plans as data: oracle counts, closed forms against the simulator, validation, the planner."""

from __future__ import annotations

import math
import subprocess
import sys
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spikeckpt import plans
from spikeckpt.errors import BudgetTooSmall, ScheduleError
from spikeckpt.plans import (
    BPTT,
    Advance,
    Backprop,
    CostModel,
    Double,
    Free,
    Load,
    Revolve,
    Store,
    Tape,
    TwoLevel,
    Uniform,
    make_schedule,
    simulate,
)
from spikeckpt.plans.twolevel import EXACT_LIMIT
from spikeckpt.units import format_bytes, parse_bytes

REVOLVE_ORACLES = [
    (10, 2, 20),
    (100, 5, 316),
    (100, 10, 222),
    (1000, 10, 3636),
    (1000, 32, 2405),
    (1000, 50, 1948),
    (10**4, 20, 37976),
    (10**5, 30, 447640),
]


def test_import_plans_does_not_import_torch() -> None:
    code = "import sys, spikeckpt.plans, spikeckpt; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("steps", "slots", "expected"), REVOLVE_ORACLES)
def test_revolve_advances_match_oracles(steps: int, slots: int, expected: int) -> None:
    assert plans.advances(steps, slots) == expected


@pytest.mark.parametrize(("steps", "slots", "expected"), REVOLVE_ORACLES[:6])
def test_revolve_schedule_counts_match_oracles(steps: int, slots: int, expected: int) -> None:
    cost = simulate(Revolve(slots).schedule(steps))
    assert cost.forward_steps == steps + expected
    assert cost.backward_steps == steps


def test_revolve_equals_gruslys_q() -> None:
    # Gruslys et al.: Q(t, m) = t + t_revolve(t, m); Q(1000, 50) = 2948.
    assert simulate(Revolve(50).schedule(1000)).forward_steps == 2948


@cache
def _exact_q(steps: int, slots: int) -> int:
    """Exact DP for the fewest evaluations (taped ones included) reversing ``steps`` steps."""
    if steps == 1:
        return 1
    if slots == 1:
        return steps * (steps + 1) // 2
    return min(m + _exact_q(steps - m, slots - 1) + _exact_q(m, slots) for m in range(1, steps))


def test_revolve_is_optimal_against_the_exact_dynamic_program() -> None:
    for slots in range(1, 7):
        for steps in range(1, 61):
            cost = simulate(Revolve(slots).schedule(steps))
            assert cost.forward_steps == _exact_q(steps, slots), (steps, slots)
            assert cost.peak_device_states <= slots + 1


def test_uniform_and_double_match_the_design_oracle() -> None:
    uniform = simulate(Uniform(50).schedule(10_000), state_bytes=1, step_bytes=3)
    assert (uniform.forward_steps, uniform.peak_bytes) == (19_950, 350)
    double = simulate(Double(1000, 20).schedule(10_000), state_bytes=1, step_bytes=3)
    assert (double.forward_steps, double.peak_bytes) == (28_800, 111)
    assert double.remote_writes + double.remote_reads == 18
    assert double.forward_steps <= 3 * 10_000 - (10_000 // 1000) * 20


def test_double_memory_is_independent_of_length() -> None:
    peaks = {
        simulate(Double(1000, 20).schedule(T), state_bytes=1, step_bytes=3).peak_bytes
        for T in (5_000, 10_000, 40_000)
    }
    assert peaks == {111}


def test_bptt_counts() -> None:
    cost = simulate(BPTT().schedule(7), state_bytes=5, step_bytes=2)
    assert (cost.forward_steps, cost.peak_bytes, cost.peak_taped_steps) == (7, 5 + 7 * 2, 7)


def test_defaults() -> None:
    assert Uniform().for_length(100).interval == 10
    assert Uniform().for_length(101).interval == 11
    assert Double().for_length(10_000) == Double(100, 10)
    assert Double(state_bytes=1, step_bytes=4).for_length(10_000).local_interval == 5


PLAN_STRATEGY = st.one_of(
    st.just(BPTT()),
    st.builds(Uniform, st.integers(1, 300)),
    st.builds(Uniform, st.none()),
    st.builds(Revolve, st.integers(1, 12)),
    st.builds(Revolve, st.integers(1, 12), st.integers(1, 80)),
    st.builds(
        lambda K, k: Double(K, min(k, K)),
        st.integers(1, 400),
        st.integers(1, 60),
    ),
    st.builds(Double, st.none(), st.none()),
    st.builds(
        TwoLevel,
        st.integers(1, 8),
        st.floats(0, 20),
        st.floats(0, 20),
        st.just(1.0),
        st.just(2.0),
        st.one_of(st.none(), st.integers(1, 300)),
    ),
)


@settings(max_examples=250, deadline=None)
@given(T=st.integers(1, 5000), plan=PLAN_STRATEGY, S=st.integers(1, 50), A=st.integers(1, 50))
def test_every_schedule_validates_and_closed_forms_are_exact(
    T: int, plan: plans.Plan, S: int, A: int
) -> None:
    fitted = plan.for_length(T)
    costs = CostModel(forward=1.0, backward=2.0, write=3.0, read=1.5, segment=0.7)
    simulated = simulate(fitted.schedule(T), state_bytes=S, step_bytes=A, costs=costs)
    assert simulated.backward_steps == T
    assert simulated.forward_steps >= T
    closed = fitted.cost(T, state_bytes=S, step_bytes=A, costs=costs)
    assert closed == simulated
    if isinstance(fitted, Revolve):
        k = fitted.tape
        n = math.ceil(T / k)
        assert simulated.peak_bytes <= (fitted.slots + 1) * S + k * A
        assert simulated.backprops == n
        # every unit is evaluated n + t(n, s) times in all; only the last unit is short
        last = T - (n - 1) * k
        assert simulated.forward_steps == (n - 1 + plans.advances(n, fitted.slots)) * k + last
        if k == 1:
            assert simulated.forward_steps == T + plans.advances(T, fitted.slots)
    if isinstance(fitted, Uniform):
        assert fitted.interval is not None
        n = math.ceil(T / fitted.interval)
        assert simulated.peak_bytes <= n * S + fitted.interval * A
    if isinstance(fitted, Double):
        assert fitted.remote_interval is not None and fitted.local_interval is not None
        K, k = fitted.remote_interval, fitted.local_interval
        assert simulated.peak_bytes <= 2 * S + math.ceil(K / k) * S + k * A
        assert simulated.forward_steps <= 3 * T


@settings(max_examples=200, deadline=None)
@given(
    T=st.integers(1, 3000),
    S=st.integers(1, 64),
    A=st.integers(1, 64),
    fraction=st.floats(0.0, 1.2),
    remote=st.booleans(),
    segment=st.sampled_from([0.0, 1.0, 8.0]),
)
def test_choose_never_exceeds_the_budget(
    T: int, S: int, A: int, fraction: float, remote: bool, segment: float
) -> None:
    bptt = S + T * A
    budget = int(fraction * bptt)
    try:
        plan = plans.choose(T, S, A, budget, remote=remote, costs=CostModel(segment=segment))
    except BudgetTooSmall as error:
        assert budget < plans.minimum_budget(T, S, A)
        assert error.minimum_bytes == plans.minimum_budget(T, S, A)
        assert str(plans.minimum_budget(T, S, A)) in str(error)
        # the budget the refusal names works when passed back
        costs = CostModel(segment=segment)
        smallest = plans.choose(T, S, A, error.minimum_bytes, remote=remote, costs=costs)
        assert smallest.cost(T, state_bytes=S, step_bytes=A).peak_bytes <= error.minimum_bytes
        return
    cost = plan.cost(T, state_bytes=S, step_bytes=A)
    assert cost.peak_bytes <= budget
    assert simulate(plan.schedule(T), state_bytes=S, step_bytes=A).peak_bytes <= budget
    assert remote or not plan.uses_remote
    if budget >= bptt:
        assert isinstance(plan, BPTT)


@settings(max_examples=300, deadline=None)
@given(
    T=st.integers(1, 2500),
    S=st.integers(1, 1000),
    A=st.integers(1, 1000),
    fraction=st.floats(0.0, 1.2),
    forward=st.sampled_from([0.0, 0.3, 1.0]),
    segment=st.sampled_from([0.0, 1.0, 40.0]),
)
def test_the_uniform_search_finds_what_a_sweep_over_every_interval_finds(
    T: int, S: int, A: int, fraction: float, forward: float, segment: float
) -> None:
    """`choose`'s Uniform candidate, from O(sqrt(T)) intervals, is the fastest fitting
    interval of all ``T`` (the shortest of ties), with the same cost."""
    from spikeckpt.plans.choose import _uniform

    costs = CostModel(forward=forward, segment=segment)
    budget = int(fraction * (S + T * A))
    best = None
    for interval in range(1, T + 1):
        cost = Uniform(interval).cost(T, state_bytes=S, step_bytes=A, costs=costs)
        if cost.peak_bytes <= budget and (best is None or cost.time < best[1].time):
            best = (interval, cost)
    found = _uniform(T, S, A, budget, costs)
    assert [(c.plan.interval, c.cost) for c in found] == ([] if best is None else [best])


def test_choose_plans_ten_million_steps() -> None:
    """`choose` at T = 10^7 with 5% of BPTT's bytes, as ``spikeckpt plan --T 10000000``
    (which swept every Uniform interval: minutes; now O(sqrt(T)) of them)."""
    T, S, A = 10**7, 64 << 10, 100 << 10
    plan = plans.choose(T, S, A, (S + T * A) // 20, remote=True)
    assert plan == Uniform(476191)


def test_choose_prefers_faster_plans_and_reports_alternatives() -> None:
    ranked = plans.rank(1000, 1, 1, 1001 // 20, costs=CostModel(write=4, read=4))
    assert ranked, "something fits at 5% of BPTT"
    times = [c.cost.time for c in ranked]
    assert times == sorted(times)
    assert all(c.cost.peak_bytes <= 50 for c in ranked)
    assert {type(c.plan) for c in ranked} >= {Revolve, Double}
    assert plans.choose(1000, 1, 1, 50, remote=False) == Revolve(48)


def test_revolve_with_a_call_overhead_tapes_several_steps_and_is_modeled_faster() -> None:
    # A CPU-like model: one autograd call costs about one step evaluation.
    costs = CostModel(forward=1.0, backward=2.0, segment=1.0)
    T, S, A = 4000, 64, 160
    budget = 64 * S + 64 * A  # what torch.utils.checkpoint per sqrt(T) segment keeps
    ranked = plans.rank(T, S, A, budget, remote=False, costs=costs)
    revolve = next(c for c in ranked if isinstance(c.plan, Revolve))
    assert isinstance(revolve.plan, Revolve) and revolve.plan.tape > 1
    assert revolve.cost.peak_bytes <= budget
    single = Revolve((budget - A) // S - 1)
    single_cost = single.cost(T, state_bytes=S, step_bytes=A, costs=costs)
    assert single_cost.peak_bytes <= budget
    assert revolve.cost.time < single_cost.time
    assert revolve.cost.backprops < single_cost.backprops == T
    # without the overhead the classic single-step schedule is kept
    plain = plans.rank(T, S, A, budget, remote=False)
    assert next(c.plan for c in plain if isinstance(c.plan, Revolve)) == single


def test_budget_too_small_names_the_minimum() -> None:
    with pytest.raises(BudgetTooSmall, match=r"smallest budget that fits is 3072 bytes"):
        plans.choose(1000, 1024, 1024, "2KiB")


def test_two_level_exact_matches_brute_force_and_periodic_is_close() -> None:
    costs = CostModel(forward=1.0, backward=2.0, write=3.0, read=3.0)
    for slots in (1, 2, 3):
        plan = TwoLevel(slots, write_cost=3.0, read_cost=3.0)
        for T in range(1, 41):
            best = _brute_force_two_level(T, slots, 6.0)
            assert plan.cost(T, costs=costs).time - 2.0 * T == pytest.approx(best), (T, slots)
    for slots, transfer in ((2, 4.0), (3, 10.0), (5, 30.0)):
        exact = TwoLevel(slots, transfer / 2, transfer / 2)
        periodic = TwoLevel(slots, transfer / 2, transfer / 2, remote_interval=exact.period())
        model = CostModel(1.0, 2.0, transfer / 2, transfer / 2)
        ratio = periodic.cost(600, costs=model).time / exact.cost(600, costs=model).time
        assert 1.0 <= ratio <= 1.045, (slots, transfer, ratio)


def _brute_force_two_level(T: int, slots: int, transfer: float) -> float:
    """Forward-unit time of the best segmentation, by a plain O(T^2) dynamic program."""

    def middle(length: int) -> float:
        return 2 * length + plans.advances(length, slots) + transfer

    prefix = [0.0] + [math.inf] * T
    for end in range(1, T + 1):
        prefix[end] = min(prefix[end - length] + middle(length) for length in range(1, end + 1))
    return min(prefix[T - last] + last + plans.advances(last, slots) for last in range(1, T + 1))


def test_two_level_uses_the_periodic_form_beyond_the_exact_limit() -> None:
    plan = TwoLevel(4, write_cost=5.0, read_cost=5.0)
    lengths = plan.segments(EXACT_LIMIT + 1000)
    assert set(lengths[:-1]) == {plan.period()}
    assert sum(lengths) == EXACT_LIMIT + 1000


def test_kukreja_asynchronous_period() -> None:
    plan = TwoLevel.asynchronous(4, write_cost=7.5, forward_cost=2.0)
    assert plan.remote_interval == 4
    # Per-step overhead is constant in T: factors at T, 10T and 100T agree within 2%.
    factors = [plan.cost(T).forward_steps / T for T in (100, 1000, 10_000)]
    assert max(factors) - min(factors) < 0.02 * min(factors)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Uniform(0),
        lambda: Uniform(-3),
        lambda: Uniform(2.5),  # type: ignore[arg-type]
        lambda: Revolve(0),
        lambda: Revolve("4"),  # type: ignore[arg-type]
        lambda: Double(0, 1),
        lambda: Double(10, 20),
        lambda: TwoLevel(0),
        lambda: TwoLevel(2, write_cost=-1),
        lambda: TwoLevel(2, remote_interval=0),
        lambda: BPTT().schedule(0),
        lambda: Revolve(3).schedule(-1),
        lambda: Uniform(3).schedule(2.0),  # type: ignore[arg-type]
        # Uniform(30).schedule(10) and Double(30, 5).schedule(10) used to raise here while
        # cost() clamped; issue #16 made one rule: intervals longer than T are clamped in
        # schedule(), cost() and for_length() alike (test_intervals_longer_than_T_clamp...).
        lambda: Double(30, 5).schedule(0),
        lambda: TwoLevel(2, forward_cost=0),
        lambda: TwoLevel(2, write_cost=float("inf")),
        lambda: TwoLevel.asynchronous(2, 5, forward_cost=0),
        lambda: TwoLevel.asynchronous(2, float("inf")),
        lambda: CostModel(write=float("nan")),
        lambda: plans.advances(5, 0),
        lambda: plans.reps(10, 0),
        lambda: plans.advances(5, -1),
        lambda: plans.advances(0, 3),
        lambda: plans.choose(10, 1, 1, "lots"),
        lambda: plans.choose(10, 0, 1, 100),
    ],
)
def test_bad_arguments_raise_value_error(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        make()


def test_interval_longer_than_sequence_is_clamped_by_for_length() -> None:
    assert Uniform(30).for_length(10) == Uniform(10)
    assert Double(30, 40 // 2).for_length(10) == Double(10, 10)
    cost = simulate(Uniform(30).for_length(10).schedule(10))
    assert cost.forward_steps == 10


@pytest.mark.parametrize(
    ("actions", "message"),
    [
        ([Advance(0, 2), Tape(3, 4)], "starts from x_3"),
        ([Tape(0, 2), Backprop(0, 2)], "must run all T=4 steps"),
        ([Tape(0, 4), Backprop(0, 3)], "not the most recent tape"),
        ([Tape(0, 2), Tape(2, 4), Backprop(0, 2)], "not the most recent tape"),
        ([Store(0, "device"), Tape(0, 4), Backprop(0, 4), Load(1, "device")], "never stored"),
        ([Tape(0, 4), Backprop(0, 4), Free(0, "device")], "not stored"),
        ([Store(1, "device")], "not x_1"),
        ([Tape(0, 4), Backprop(0, 4), Tape(0, 1)], "no current state"),
        ([Store(0, "device"), Tape(0, 4), Backprop(0, 4)], "still stored"),
        ([Advance(0, 4)], "before backpropagating to x_0"),
        ([Advance(0, 5)], "0 <= start < stop <= T=4"),
        ([Store(0, "tape")], "unknown tier"),  # type: ignore[arg-type]
    ],
)
def test_broken_schedules_name_the_action(actions: list, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        simulate(make_schedule(4, actions))


def test_schedule_phases() -> None:
    schedule = Uniform(2).schedule(5)
    assert all(not isinstance(a, (Backprop, Load)) for a in schedule.forward)
    assert isinstance(schedule.backward[0], Backprop)
    assert len(schedule.forward) + len(schedule.backward) == len(schedule)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5 GiB", 3 * 2**29), ("4096", 4096), (7, 7)],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "12 parsecs", "-1MiB", "MiB", True, 1.5, float("inf"), None])
def test_parse_bytes_rejects_garbage(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_bytes(bad)  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(12) == "12 B"


# ----------------------------------------------------------------------------- layer-wise model


def test_packed_bytes_picks_the_smaller_codec() -> None:
    dense = 32 * 700 * 4  # one SHD step at batch 32, float32
    assert plans.packed_bytes(dense, None) == dense
    assert plans.packed_bytes(dense, 0.5) == 32 * 700 // 8  # bit-packed
    assert plans.packed_bytes(dense, 0.05) == 2 * math.ceil(0.05 * 32 * 700)  # index list
    assert plans.packed_bytes(dense, 0.05) * 30 <= dense
    with pytest.raises(ValueError, match="density"):
        plans.packed_bytes(dense, 1.5)


def test_layerwise_cost_follows_its_formula() -> None:
    blocks = [
        plans.BlockSizes(state_bytes=10, step_bytes=100, input_bytes=40, output_bytes=20),
        plans.BlockSizes(state_bytes=6, step_bytes=50, input_bytes=20, output_bytes=8, density=0.0),
    ]
    cost = plans.layerwise_cost(100, 10, blocks)
    assert (cost.chunk, cost.n_chunks, cost.forward_steps) == (10, 10, 200)
    assert cost.peak_bytes == 2 * 16 + 10 * (100 + 2 * 40 + 20)
    # block 1's input is the caller's; block 2's all-zero train packs to 0 index bytes
    assert cost.remote_bytes == 100 * 0 + 9 * 16
    local = plans.layerwise_cost(100, 10, blocks, remote=False)
    assert local.peak_bytes == cost.peak_bytes + 9 * 16 and local.remote_bytes == 0
    assert cost.time == 100 * (2 * 1.0 + 2.0) and cost.time_factor(plans.CostModel()) == 4 / 3
    assert plans.layerwise_cost(5, 50, blocks).chunk == 5  # clipped to T
    with pytest.raises(ValueError, match="chunk >= 1"):
        plans.layerwise_cost(5, 0, blocks)
    with pytest.raises(ValueError, match="at least one block"):
        plans.layerwise_cost(5, 1, [])


@settings(max_examples=50, deadline=None)
@given(T=st.integers(1, 500), budget=st.integers(0, 50_000), preferred=st.integers(1, 600))
def test_fitting_chunk_is_the_largest_that_fits(T: int, budget: int, preferred: int) -> None:
    blocks = [plans.BlockSizes(64, 300, 80, 40, 0.1), plans.BlockSizes(32, 200, 40, 10, 0.2)]
    k = plans.fitting_chunk(T, blocks, budget, preferred)
    if k is None:
        assert plans.layerwise_cost(T, 1, blocks).peak_bytes > budget
        return
    assert 1 <= k <= min(preferred, T)
    assert plans.layerwise_cost(T, k, blocks).peak_bytes <= budget
    if k < min(preferred, T):
        assert plans.layerwise_cost(T, k + 1, blocks).peak_bytes > budget


def test_measured_working_interpolates_and_extends_by_its_slope() -> None:
    # short chunks peak while the gradient sums are held (a flat line), long ones on the tape
    working = plans.MeasuredWorking(((1, 700), (2, 730), (4, 800), (8, 1000)), base_slope=80)
    assert working.slope == 80  # the chords (30, 35, 50 per step) are below the cost model's
    assert [working(k) for k in (1, 2, 3, 4, 6, 8)] == [700, 730, 765, 800, 900, 1000]
    # past the longest length: the slope raised by EXTRAPOLATION_MARGIN (5/4)
    assert plans.layerwise.EXTRAPOLATION_MARGIN == (5, 4)
    assert working(16) == 1000 + 8 * 100
    steep = plans.MeasuredWorking(((1, 100), (2, 300)), base_slope=80)
    assert steep.slope == 200 and steep(5) == 300 + 3 * 250
    # what a probe of the first lengths alone would have found: stopped short, it counts at
    # most what its longest length holds per step past it (730 / 2)
    assert working.prefix(2) == plans.MeasuredWorking(((1, 700), (2, 730)), 365)
    assert working.prefix(2)(8) == 730 + 6 * 457 > working(8)
    # lengths measured past a turn the shorter ones do not show: a probe stopped short of
    # them counts ``short_slope`` (the cost model's) past its longest where it is more
    turning = plans.MeasuredWorking(((10, 700), (20, 730), (40, 800)), 35, short_slope=120)
    assert turning.prefix(3) == turning and turning.prefix(9) == turning
    assert turning.prefix(2).base_slope == 120 and turning.prefix(2)(40) == 730 + 20 * 150
    assert turning.scaled(32, 16).short_slope == 240
    assert working.scaled(32, 16)(8) == 2000 and working.scaled(8, 16) is working
    blocks = [plans.BlockSizes(16, 100, 40, 20, 0.1)]
    cost = plans.layerwise_cost(100, 6, blocks, working=working)
    assert cost.peak_bytes == 2 * 16 + 900
    assert plans.fitting_chunk(100, blocks, 2 * 16 + 900, 100, working=working) == 6
    for bad in [(), ((0, 10),), ((2, 10), (1, 20)), ((1, 20), (2, 10))]:
        with pytest.raises(ValueError, match="measured"):
            plans.MeasuredWorking(bad, 80)  # type: ignore[arg-type]


@settings(max_examples=50, deadline=None)
@given(
    points=st.lists(st.integers(0, 5000), min_size=1, max_size=4),
    base=st.integers(1, 500),
    k=st.integers(1, 200),
)
def test_measured_working_never_falls_and_bounds_every_point(
    points: list[int], base: int, k: int
) -> None:
    lengths = [1, 2, 4, 8][: len(points)]
    held = [sum(points[: i + 1]) for i in range(len(points))]  # never falling
    working = plans.MeasuredWorking(tuple(zip(lengths, held, strict=True)), base)
    assert working(k) <= working(k + 1)
    for length, bytes_ in zip(lengths, held, strict=True):
        assert working(length) == bytes_
    numerator, denominator = plans.layerwise.EXTRAPOLATION_MARGIN
    assert working(k + 1) - working(k) <= -(-working.slope * numerator // denominator)


@settings(max_examples=60, deadline=None)
@given(T=st.integers(1, 300), K=st.integers(1, 400), k=st.integers(1, 400))
def test_a_double_without_remote_checkpoint_runs_as_the_uniform_it_is(
    T: int, K: int, k: int
) -> None:
    """``as_run`` names a Double by what it runs: with ``K >= T`` it writes no remote
    checkpoint and its schedule, counts and peak are exactly ``Uniform(k)``'s."""
    plan = Double(K, min(k, K))
    ran = plan.as_run(T)
    if min(K, T) < T:
        assert ran == plan.for_length(T)
        assert plan.cost(T).remote_writes > 0
        return
    assert isinstance(ran, Uniform) and ran.interval == min(k, K, T)
    assert list(plan.schedule(T)) == list(ran.schedule(T))
    assert plan.cost(T, state_bytes=3, step_bytes=5) == ran.cost(T, state_bytes=3, step_bytes=5)
    assert Uniform(7).as_run(T) == Uniform(7).for_length(T)  # other plans: for_length


def test_plan_repr_lists_every_argument_that_is_not_its_default() -> None:
    assert repr(Uniform()) == "Uniform()"
    assert repr(Double(state_bytes=4, step_bytes=8)) == "Double(state_bytes=4, step_bytes=8)"
    two = TwoLevel(8, write_cost=2.5, read_cost=1.5, remote_interval=40)
    assert repr(two) == "TwoLevel(slots=8, write_cost=2.5, read_cost=1.5, remote_interval=40)"
    assert eval(repr(two), {"TwoLevel": TwoLevel}) == two  # noqa: S307 - whole, rebuildable


def test_layerwise_counts_a_replay_state_per_chunk_of_a_drawing_block() -> None:
    """A block that draws random numbers keeps its generator state per chunk (to replay the
    draws in the recomputation), and the backward one more (where its own draws stand): the
    peak counts ``(chunks + 1) * rng_bytes``, so short chunks can cost more than long ones,
    and the chunk search finds a fitting length where chunks of one step do not fit."""
    from spikeckpt.plans.layerwise import BlockSizes, fitting_chunk, layerwise_cost

    quiet = [BlockSizes(64, 32, 80, 128), BlockSizes(16, 16, 128, 20)]
    drawing = [BlockSizes(64, 32, 80, 128, rng_bytes=5056), quiet[1]]
    T = 200
    for k in (1, 7, 50, 200):
        extra = layerwise_cost(T, k, drawing).peak_bytes - layerwise_cost(T, k, quiet).peak_bytes
        assert extra == (-(-T // k) + 1) * 5056
    budget = layerwise_cost(T, 40, drawing).peak_bytes
    assert layerwise_cost(T, 1, drawing).peak_bytes > budget
    found = fitting_chunk(T, drawing, budget, T)
    assert found is not None and found >= 40
    assert layerwise_cost(T, found, drawing).peak_bytes <= budget
    assert fitting_chunk(T, drawing, 1000, T) is None


@pytest.mark.parametrize("grad_in_step", [True, False], ids=["wrap", "MemoryBudget"])
def test_a_chosen_plan_s_step_fits_the_budget_bptt_s_gradients_included(
    grad_in_step: bool,
) -> None:
    """``BPTT()`` counts its gradients apart (autograd's sums, one new gradient and its sum):
    with ``.grad`` in the model's account and one weight-bound parameter, its step is more than
    the room the checkpointing plans leave. Before, ``MemoryBudget``'s account chose it anyway
    (an 8.5 MiB budget, a 12.1 MiB step modeled)."""
    sizes = plans.StepSizes(
        state=1024, tape=1024, grads=4 << 20, largest=4 << 20, grad_in_step=grad_in_step
    )
    chosen = 0
    for budget in range(5 << 20, 16 << 20, 1 << 19):
        try:
            choice = plans.choose_step(100, sizes, budget, remote=False)
        except BudgetTooSmall:
            continue
        chosen += 1
        assert choice.step.total <= budget, (budget, choice.plan, choice.step)
        ranked = plans.rank_steps(100, sizes, budget, remote=False)
        assert ranked[0].plan == choice.plan
        assert all(c.step.total <= budget for c in ranked)
    assert chosen >= 5
