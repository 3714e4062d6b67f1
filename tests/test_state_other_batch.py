"""A state carried into a window of another batch (a previous batch's final state, a smaller
last batch): Norse cells and neurons of yours are refused naming the layer, as snnTorch's are,
where torch's shape error named neither (helper h40)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt
from spikeckpt.errors import ConfigError

norse = pytest.importorskip("norse.torch")


class _MyLIF(nn.Module):
    """A neuron of yours whose state starts from None."""

    def forward(self, x: torch.Tensor, mem: torch.Tensor | None = None) -> tuple:
        mem = x if mem is None else 0.8 * mem + x
        spk = (mem > 1).float()
        return spk, mem - spk


def _models() -> list[tuple[str, nn.Module, int]]:
    return [
        (
            "seq_lif",
            norse.SequentialState(
                nn.Linear(6, 8), norse.LIFCell(), nn.Linear(8, 3), norse.LICell()
            ),
            6,
        ),
        ("seq_last_li", norse.SequentialState(nn.Linear(6, 3), norse.LICell()), 6),
        ("cell", norse.LIFCell(), 3),
        ("own", nn.Sequential(nn.Linear(6, 4), _MyLIF()), 6),
    ]


# (layer-wise refuses the neuron of yours, which starts from None: no "own" x "layer" case)
@pytest.mark.parametrize(
    ("case", "granularity"),
    [(case, g) for case in range(4) for g in ("stack", "layer") if (case, g) != (3, "layer")],
)
def test_state_of_another_batch_is_refused_naming_the_layer(case: int, granularity: str) -> None:
    name, model, c = _models()[case]
    assert name != "own" or granularity == "stack"
    torch.manual_seed(0)
    seq = spikeckpt.wrap(model, granularity=granularity)
    _, state = seq(torch.rand(5, 4, c), return_state=True)
    with pytest.raises(ConfigError, match=r"state= for layer .*batch of 4.*batch of 3"):
        seq(torch.rand(5, 3, c), state=state, return_state=True)


def test_state_of_the_batch_still_continues_the_loop() -> None:
    torch.manual_seed(0)
    model = norse.SequentialState(nn.Linear(6, 8), norse.LIFCell(), nn.Linear(8, 3), norse.LICell())
    x = torch.rand(10, 4, 6) * 2
    state, outs = None, []
    for t in range(10):
        y, state = model(x[t], state)
        outs.append(y)
    seq = spikeckpt.wrap(model)
    y1, s = seq(x[:6])
    y2, _ = seq(x[6:], state=s)
    torch.testing.assert_close(torch.cat([y1, y2]), torch.stack(outs))
