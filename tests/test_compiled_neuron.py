"""The layer-wise fused neurons compiled for real (``compile=True``, `spikeckpt.engine.compiled`):
every chunk of a run of several lengths, grad modes and layers runs compiled, without a graph
break, within dynamo's recompile limit, bitwise the eager kernels' outputs and gradients."""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import snntorch as snn
import torch
from torch import nn
from torch._dynamo.utils import counters

import spikeckpt as sc
from spikeckpt.engine import compiled

pytestmark = [
    pytest.mark.slow,  # each new chunk shape compiles for a second or two
    pytest.mark.skipif(
        compiled.compiler_missing("cpu") is not None, reason="no C++ compiler for inductor"
    ),
]


def _models() -> dict[str, nn.Sequential]:
    """Two layers of one neuron kind each: the kernels of a kind share one ``forward``."""
    models = {
        "Leaky": nn.Sequential(
            nn.Linear(6, 8),
            snn.Leaky(beta=0.9, learn_beta=True, learn_threshold=True),
            nn.Linear(8, 3),
            snn.Leaky(beta=0.8, reset_mechanism="zero"),
        ),
        "Synaptic": nn.Sequential(
            nn.Linear(6, 8),
            snn.Synaptic(alpha=0.8, beta=0.9),
            nn.Linear(8, 3),
            snn.Synaptic(alpha=0.7, beta=0.8),
        ),
    }
    try:
        import norse.torch as norse
    except ImportError:  # pragma: no cover - norse is a test dependency
        return models
    models["LIFCell"] = nn.Sequential(
        nn.Linear(6, 8), norse.LIFCell(), nn.Linear(8, 3), norse.LIFCell()
    )
    return models


@pytest.mark.parametrize("kind", ["Leaky", "Synaptic", "LIFCell"])
def test_every_chunk_of_many_shapes_runs_compiled_without_graph_breaks(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three sequence lengths (chunks of 4 and a shorter last one), forward + backward and a
    forward without grad, two layers of different widths: 14 keys per layer. Dynamo would run
    code past its recompile limit (8 entries per code object) eagerly, unseen by the caller;
    here that limit fails loudly, so a chunk past it runs eager and says "fused". (The timing
    that keeps a slower compiled forward eager is set aside: every key compiles and runs.)"""
    monkeypatch.setattr(compiled, "compiled_is_faster", lambda *args: True)
    models = _models()
    if kind not in models:
        pytest.skip("norse is not installed")
    torch.manual_seed(0)
    net = models[kind]
    eager = sc.wrap(net, granularity="layer", chunk=4, compile=False)
    seq = sc.wrap(net, granularity="layer", chunk=4, compile=True)
    breaks = sum(counters["graph_break"].values())
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for T in (11, 7, 13):
            x = (torch.rand(T, 3, 6) < 0.4).float()
            chunks = {"compiled": -(-T // 4)}
            got = seq(x)
            got.sum().backward()
            assert [b.neuron_chunks for b in seq.last_stats.blocks] == [chunks, chunks]
            got_grads = [p.grad for p in net.parameters()]
            net.zero_grad(set_to_none=True)
            want = eager(x)
            want.sum().backward()
            assert torch.equal(got, want)
            for a, b in zip(got_grads, [p.grad for p in net.parameters()], strict=True):
                assert torch.equal(a, b)
            net.zero_grad(set_to_none=True)
            with torch.no_grad():
                assert torch.equal(seq(x), want)
            assert [b.neuron_chunks for b in seq.last_stats.blocks] == [chunks, chunks]
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])


def test_a_slower_compiled_forward_is_kept_eager_and_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compiled forward that gives the eager values but takes longer (here 5 ms more per
    call) is timed on the first chunk of its key, never used, counted "fused", with one line."""
    slow: list[int] = []
    real_compile = torch.compile

    def slow_compile(fn: Any, **kwargs: Any) -> Any:
        done = real_compile(fn, **kwargs)

        def run(*args: Any) -> Any:
            slow.append(1)
            time.sleep(0.005)
            return done(*args)

        return run

    monkeypatch.setattr(compiled.torch, "compile", slow_compile)
    monkeypatch.setattr(compiled, "_WARNED", set())
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), snn.Leaky(beta=0.9))
    x = (torch.rand(9, 3, 6) < 0.4).float()
    want = sc.wrap(net, granularity="layer", chunk=4, compile=False)(x)
    seq = sc.wrap(net, granularity="layer", chunk=4, compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = seq(x)
    assert seq.last_stats.blocks[0].neuron_chunks == {"fused": 3}
    assert torch.equal(got, want)
    assert any("slower than the eager one" in str(w.message) for w in caught)
    calls = len(slow)
    assert calls == 2 * (1 + compiled.TIMED_CALLS)  # two keys (chunk 4, last 1): check + timing
    seq(x)
    assert len(slow) == calls  # not called again


@pytest.mark.parametrize("kind", ["Synaptic", "Alpha"])
def test_a_top_neuron_emitting_its_states_runs_compiled(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Synaptic`` / ``Alpha(init_hidden=True, output=True)`` at the top: the wrapped net
    returns the call's ``spk, syn, mem`` (``spk, syn_exc, syn_inh, mem``), which the compiled
    kernel emits per step: every chunk compiled, bitwise the eager run, gradients of a loss
    on every output bitwise too (the backward is the eager kernel's)."""
    monkeypatch.setattr(compiled, "compiled_is_faster", lambda *args: True)
    torch.manual_seed(0)
    neuron = getattr(snn, kind)
    net = nn.Sequential(
        nn.Linear(6, 8), neuron(alpha=0.8, beta=0.7, init_hidden=True),
        nn.Linear(8, 3), neuron(alpha=0.8, beta=0.7, init_hidden=True, output=True),
    )  # fmt: skip
    x = (torch.rand(9, 3, 6) < 0.4).float()
    found = []
    for compile in (True, False):
        seq = sc.wrap(net, granularity="layer", chunk=4, compile=compile)
        outs = seq(x)
        way = "compiled" if compile else "fused"
        assert [b.neuron_chunks for b in seq.last_stats.blocks] == [{way: 3}, {way: 3}]
        loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in outs)
        found.append((outs, torch.autograd.grad(loss, list(net.parameters()))))
    (got, got_grads), (want, want_grads) = found
    assert len(got) == (4 if kind == "Alpha" else 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))


def test_generated_triton_code_rounds_as_eager_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The H100 and H200 runs kept the compiled neuron eager: Triton's code differed from the
    eager kernels (Triton contracts ``a * b + c`` into one FMA, eager CUDA rounds each op).
    Every compile of ours passes `eager_numerics`; under it inductor's Triton launches ask for
    no FP fusion and a correctly rounded division (read from inductor's own code generator,
    which needs no GPU). A key this torch's inductor lacks is left out, not passed."""
    from torch._inductor import config
    from torch._inductor.codegen.triton import TritonKernel

    options = compiled.eager_numerics()
    assert options == {"emulate_precision_casts": True, "eager_numerics.division_rounding": True}
    assert TritonKernel.triton_meta_common()["enable_fp_fusion"] is True  # inductor's default
    with config.patch(options):
        assert TritonKernel.triton_meta_common()["enable_fp_fusion"] is False
        assert config.eager_numerics.division_rounding is True
    monkeypatch.setattr(compiled, "EAGER_NUMERICS", {"no_such.setting": True, "nor_this": 1})
    compiled.eager_numerics.cache_clear()
    try:
        assert compiled.eager_numerics() == {}
    finally:
        compiled.eager_numerics.cache_clear()


def test_the_fused_neuron_compiles_with_eager_numerics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each compiled copy of a fused neuron's forward is made with `eager_numerics` (the real
    ``torch.compile``, watched)."""
    seen: list[dict[str, Any]] = []
    real = torch.compile

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("options") or {})
        return real(*args, **kwargs)

    monkeypatch.setattr(compiled.torch, "compile", watched)
    monkeypatch.setattr(compiled, "compiled_is_faster", lambda *args: True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), snn.Leaky(beta=0.9))
    seq = sc.wrap(net, granularity="layer", chunk=3, compile=True)
    seq((torch.rand(6, 2, 4) < 0.5).float()).sum().backward()
    assert seen and all(options == compiled.eager_numerics() for options in seen)
    assert seq.last_stats.blocks[0].neuron_chunks == {"compiled": 2}
