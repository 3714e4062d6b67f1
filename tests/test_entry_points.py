"""Strict entry points: wrap lists its keywords, every option runs in its granularity or is
refused there, forward takes state and return_state by keyword, scan returns one shape."""

from __future__ import annotations

import pytest
import snntorch as snn
import torch
from torch import nn

import spikeckpt as sc
from spikeckpt.models import LIFStack
from spikeckpt.plans import Uniform


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), snn.Leaky(beta=0.9), nn.Linear(8, 3), snn.Leaky(0.9))


def _x(T: int = 9, B: int = 2) -> torch.Tensor:
    torch.manual_seed(1)
    return (torch.rand(T, B, 6) < 0.4).float()


def test_a_keyword_typo_is_a_type_error_at_wrap() -> None:
    with pytest.raises(TypeError, match="budegt"):
        sc.wrap(_net(), budegt="1MiB")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="stats"):
        sc.wrap(_net(), stats=True)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"granularity": "layer", "pack_tape": True}, "pack_tape"),
        ({"granularity": "auto", "pack_tape": True}, "pack_tape"),
        ({"granularity": "stack", "chunk": 4}, "chunk"),
        ({"granularity": "layer", "readout": lambda acc, y, t: y}, "callable readout"),
        ({"granularity": "layers"}, "granularity"),
    ],
)
def test_options_a_granularity_cannot_run_are_refused_at_wrap(options: dict, match: str) -> None:
    with pytest.raises(sc.ConfigError, match=match):
        sc.wrap(_net(), **options)


def test_every_option_runs_in_both_granularities() -> None:
    x = _x()
    for granularity in ("stack", "layer"):
        chunk = 3 if granularity == "layer" else None
        for readout in (None, "sum", "mean", "last"):
            for output in ("spikes", "mem", "both"):
                seq = sc.wrap(
                    _net(), plan=Uniform(3), readout=readout, output=output,
                    granularity=granularity, chunk=chunk,
                )  # fmt: skip
                ys = seq(x)
                assert seq.last_decision is not None
                assert seq.last_decision.granularity == granularity
                assert ys is not None
    bf = sc.wrap(_net(), plan=Uniform(3), batch_first=True, granularity="layer", chunk=3)
    assert bf(x.transpose(0, 1)).shape == (2, 9, 3)
    packed = sc.wrap(_net(), plan=Uniform(3), pack_tape=True)
    torch.testing.assert_close(packed(x), sc.wrap(_net(), plan=Uniform(3))(x))


def test_forward_takes_state_and_return_state_by_keyword() -> None:
    x = _x()
    seq = sc.wrap(_net(), plan=Uniform(3))
    full, s_full = seq(x, return_state=True)
    a, s = seq(x[:4], return_state=True)
    b, s2 = seq(x[4:], state=s, return_state=True)
    torch.testing.assert_close(torch.cat([a, b]), full)
    with pytest.warns(DeprecationWarning, match="by keyword"):
        b_old, _ = seq(x[4:], True, s)  # the old positional order still runs
    torch.testing.assert_close(b_old, b)
    with pytest.warns(DeprecationWarning, match="by keyword"):
        b_norse, _ = seq(x[4:], s)  # Norse-style seq(x, state)
    torch.testing.assert_close(b_norse, b)


def test_scan_returns_one_shape_with_the_stats_beside() -> None:
    net = LIFStack((6, 8, 3))
    x = _x()
    for stats_kind in ("loop (no grad)", "Uniform"):
        grad = stats_kind == "Uniform"
        with torch.set_grad_enabled(grad):
            out = sc.scan(net.step, x, net.initial_state(2), plan=Uniform(3), readout="sum")
        assert isinstance(out, sc.ScanResult) and len(out) == 2
        ys, state = out
        assert ys is out.ys and state is out.state
        assert isinstance(out.stats, sc.ScanStats) and out.stats.plan.startswith(stats_kind)
    with pytest.warns(DeprecationWarning, match="stats=True"):
        triple = sc.scan(net.step, x, net.initial_state(2), plan=Uniform(3), stats=True)
    assert len(triple) == 3 and isinstance(triple[2], sc.ScanStats)


def test_budget_too_small_counts_the_steps_the_user_runs() -> None:
    """A state that step 0 shapes runs step 0 apart: the refusal still says T=300."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(6, 8) * 0.3)

    def step(v: torch.Tensor, x_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = v if v.numel() else torch.zeros(x_t.shape[0], 8)  # shaped by step 0
        v = 0.9 * v + x_t @ weight
        return v, v.sigmoid()

    x = (torch.rand(300, 2, 6) < 0.3).float()
    with pytest.raises(sc.BudgetTooSmall, match="T=300 steps") as err:
        sc.scan(step, x, torch.empty(0), plan="auto", budget=64, params=[weight])
    assert "T=299" not in str(err.value).split("(")[0]
