"""`scan` refuses a tuple of time-first inputs of one shape, which a sequence would run as
2 steps instead of T (h39's finding: with ``readout="sum"`` the output had the loop's shape
and was 8.6 off, silently); the list forms run as the loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc

T, B, C, H = 12, 4, 6, 8


def _setup() -> tuple[nn.Linear, nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(C, H), nn.Linear(C, H), torch.randn(T, B, C), torch.randn(T, B, C)


def test_a_tuple_of_time_first_inputs_of_one_shape_is_refused_naming_zip() -> None:
    fa, fb, a, b = _setup()

    def step(h: torch.Tensor, inp: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(0.9 * h + fa(inp[0]) + fb(inp[1]))
        return h, h

    for plan in (sc.plans.BPTT(), sc.plans.Uniform(3)):
        with pytest.raises(sc.ConfigError, match=r"list\(zip\(a, b\)\)") as caught:
            sc.scan(step, (a, b), torch.zeros(B, H), plan=plan, readout="sum")
        assert "sequence of 2 steps" in str(caught.value)
        assert "(12, 4, 6)" in str(caught.value)


def test_the_list_forms_run_as_the_loop() -> None:
    fa, fb, a, b = _setup()

    def step(h: torch.Tensor, inp: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(0.9 * h + fa(inp[0]) + fb(inp[1]))
        return h, h

    h, acc = torch.zeros(B, H), torch.zeros(B, H)
    for t in range(T):
        h, y = step(h, (a[t], b[t]))
        acc = acc + y
    out, _ = sc.scan(
        step,
        list(zip(a, b, strict=True)),
        torch.zeros(B, H),
        plan=sc.plans.Uniform(3),
        readout="sum",
    )
    assert torch.equal(out, acc)

    def one(h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(0.9 * h + fa(x))
        return h, h

    steps = list(a.unbind(0)[:3])  # 3 per-step inputs (B, C), B > 3: a list is never refused
    ys, _ = sc.scan(one, steps, torch.zeros(B, H), plan=sc.plans.BPTT())
    h = torch.zeros(B, H)
    for t in range(3):
        h, _ = one(h, a[t])
    assert ys.shape == (3, B, H) and torch.equal(ys[-1], h)


def test_a_tuple_of_per_step_inputs_longer_than_their_first_axis_still_runs() -> None:
    fa, _, a, _ = _setup()

    def one(h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(0.9 * h + fa(x))
        return h, h

    ys, _ = sc.scan(one, a.unbind(0), torch.zeros(B, H), plan=sc.plans.Uniform(4))
    assert ys.shape == (T, B, H)


def test_a_dict_of_time_first_inputs_is_refused_naming_per_step_dicts() -> None:
    fa, fb, a, b = _setup()

    def step(h: torch.Tensor, inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(0.9 * h + fa(inp["x"]) + fb(inp["ctx"]))
        return h, h

    d = {"x": a, "ctx": b}
    with pytest.raises(sc.ConfigTypeError, match=r"zip\(\*d\.values\(\)\)"):
        sc.scan(step, d, torch.zeros(B, H), plan=sc.plans.BPTT())
    per_step = [dict(zip(d, v, strict=True)) for v in zip(*d.values(), strict=True)]
    out, _ = sc.scan(step, per_step, torch.zeros(B, H), plan=sc.plans.Uniform(5), readout="sum")
    h, acc = torch.zeros(B, H), torch.zeros(B, H)
    for t in range(T):
        h, y = step(h, {"x": a[t], "ctx": b[t]})
        acc = acc + y
    assert torch.equal(out, acc)
