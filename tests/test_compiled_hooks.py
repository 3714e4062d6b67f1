"""Module hooks registered or removed after the stack step compiled (``compile=True`` and
``"auto"``): the wrapped run follows them as the plain loop does. Dynamo does not guard on
module hooks, so a step compiled before a hook ran without it: silently other outputs and
gradients (23 off on this net) until `hooks_key` made the wrapper compile afresh."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import snntorch as snn
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

import spikeckpt as sc
from spikeckpt.engine import auto_compile, compiled

pytestmark = [
    pytest.mark.slow,  # the step compiles for a few seconds, again after each hook change
    pytest.mark.skipif(
        compiled.compiler_missing("cpu") is not None, reason="no C++ compiler for inductor"
    ),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _net() -> tuple[nn.Sequential, Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), snn.Leaky(beta=0.9), nn.Linear(6, 4), snn.Leaky(0.8))
    return net, (torch.rand(8, 2, 3) < 0.5).float() * 1.5


def _loop(net: nn.Sequential, x: Tensor) -> Tensor:
    """The user's snnTorch loop."""
    mem1, mem2 = net[1].init_leaky(), net[3].init_leaky()
    out = []
    for t in range(x.shape[0]):
        spk1, mem1 = net[1](net[0](x[t]), mem1)
        spk2, mem2 = net[3](net[2](spk1), mem2)
        out.append(spk2)
    return torch.stack(out)


def _step(run: Callable[[Tensor], Tensor], net: nn.Module, x: Tensor) -> list[Tensor]:
    """One training step: the output, then every parameter's gradient."""
    net.zero_grad(set_to_none=True)
    out = run(x)
    (out * torch.linspace(-1, 1, out.shape[-1]) + 0.1 * out**2).sum().backward()
    return [out.detach(), *(p.grad.clone() for p in net.parameters())]


def _assert_as_loop(seq: nn.Module, net: nn.Module, x: Tensor) -> None:
    """One training step of ``seq`` gives the loop's output and gradients."""
    want, got = _step(lambda z: _loop(net, z), net, x), _step(seq, net, x)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@contextmanager
def _recompile_warnings() -> Iterator[list[str]]:
    """The messages of dynamo's recompile-limit warnings logged inside the block."""
    hits: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "recompile_limit" in record.getMessage():
                hits.append(record.getMessage())

    catch = Catch()
    logging.getLogger("torch._dynamo").addHandler(catch)
    try:
        yield hits
    finally:
        logging.getLogger("torch._dynamo").removeHandler(catch)


HOOKS: dict[str, Callable[[nn.Sequential], RemovableHandle]] = {
    "forward": lambda net: net[2].register_forward_hook(lambda m, a, out: out * 2),
    "forward_pre": lambda net: net[0].register_forward_pre_hook(lambda m, a: (a[0] + 0.5,)),
    "full_backward": lambda net: net[2].register_full_backward_hook(
        lambda m, gin, gout: (gin[0] * 3,)
    ),
    "full_backward_pre": lambda net: net[2].register_full_backward_pre_hook(
        lambda m, gout: (gout[0] * 3,)
    ),
}


@pytest.mark.parametrize(
    ("mode", "kind"), [*((True, kind) for kind in sorted(HOOKS)), ("auto", "full_backward")]
)
def test_a_hook_added_and_removed_after_compiling_runs_as_in_the_loop(
    monkeypatch: pytest.MonkeyPatch, kind: str, mode: bool | str
) -> None:
    monkeypatch.setattr(auto_compile, "COMPILE_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(auto_compile, "KEEP_RATIO", float("inf"))
    net, x = _net()
    seq = sc.wrap(net, plan=sc.plans.Uniform(interval=3), compile=mode)
    for _ in range(3):  # compiled by now
        _step(seq, net, x)
    assert seq.last_stats.step_compiled
    handle = HOOKS[kind](net)
    _assert_as_loop(seq, net, x)
    handle.remove()
    for _ in range(2):  # "auto" compiles afresh after the hook's calls ran eagerly
        _assert_as_loop(seq, net, x)


def test_batch_sizes_and_grad_modes_stay_compiled_past_the_recompile_limit() -> None:
    """Three batch sizes, each trained twice and evaluated under ``no_grad``: nine compiled
    versions of the step, past dynamo's ``recompile_limit`` (8) for one function, which ran
    the third batch size eagerly (2x slower, `step_compiled` True all the same, one log line)
    while one compiled copy served every shape. Each shape and grad mode has its own now."""
    with _recompile_warnings() as hits:
        net, _ = _net()
        seq = sc.wrap(net, plan=sc.plans.BPTT(), compile=True)
        for batch in (1, 2, 3):
            x = (torch.rand(6, batch, 3) < 0.5).float() * 1.5
            for _ in range(2):
                _assert_as_loop(seq, net, x)
                assert seq.last_stats.step_compiled
            with torch.no_grad():
                assert torch.equal(seq(x), _loop(net, x))
    assert hits == []


def test_a_full_backward_hook_does_not_recompile_the_saved_tensor_hooks() -> None:
    """Around the graph break of a full backward hook dynamo compiled spikeckpt's saved-tensor
    pack hook as a frame of its own, guarded on its running byte count: 16 graphs in the
    first calls and dynamo's recompile-limit warning naming ``_pack`` (h37; results exact).
    The hooks are never compiled now: every call's results as the loop's, no warning."""
    with _recompile_warnings() as hits:
        net, x = _net()
        HOOKS["full_backward"](net)
        seq = sc.wrap(net, plan=sc.plans.Uniform(interval=3), compile=True)
        for _ in range(10):
            _assert_as_loop(seq, net, x)
        assert seq.last_stats.step_compiled
    assert hits == []
