"""A Norse model under ``MemoryBudget`` with a real Lightning ``Trainer`` (CPU), as a user's
second hour goes: Norse's MNIST-task network (``Linear``, ``LIFCell``, an ``LILinearCell``
readout, the max over time, ``log_softmax`` and ``nll_loss``) trained through the callback
with gradient accumulation and clipping equals the same training of Norse's own loop without
spikeckpt; a fit resumed from a ``ModelCheckpoint`` equals the uninterrupted fit, restores the
callback's plans without probing, and the checkpoint loads into an inference model without
the callback, and predicts with it attached (no fit) as without."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    nt = pytest.importorskip("norse.torch")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from quiet_trainer import quiet_trainer  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import spikeckpt  # noqa: E402
from spikeckpt.lightning import MemoryBudget  # noqa: E402
from spikeckpt.plans import BPTT  # noqa: E402
from spikeckpt.units import parse_bytes  # noqa: E402

T, B, C, HIDDEN, K = 40, 4, 12, 16, 5


class NorseTask(pl.LightningModule):
    """Norse's MNIST task: ``voltages, _ = torch.max(voltages, 0)``, ``log_softmax``,
    ``nll_loss``; the network wrapped (``readout="max"``) or run by Norse's own loop."""

    def __init__(self, wrapped: bool = True, granularity: str = "stack") -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        net = nt.SequentialState(nn.Linear(C, HIDDEN), nt.LIFCell(), nt.LILinearCell(HIDDEN, K))
        self.net = spikeckpt.wrap(net, readout="max", granularity=granularity) if wrapped else net
        self.losses: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        """``x`` (T, B, C) -> voltages (B, K), the max over time."""
        if self.hparams["wrapped"]:
            voltages, _ = self.net(x)
            return voltages
        state, out = None, []
        for x_t in x:
            v, state = self.net(x_t, state)
            out.append(v)
        voltages, _ = torch.max(torch.stack(out), 0)
        return voltages

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.nll_loss(F.log_softmax(self(x), dim=1), y)
        self.losses.append(loss.detach())
        return loss

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=5e-3)


def _loader(batches: int = 4, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    data = [
        (
            (torch.rand(T, B, C, generator=generator) < 0.3).float(),
            torch.randint(0, K, (B,), generator=generator),
        )
        for _ in range(batches)
    ]
    return DataLoader(data, batch_size=None)


def _fit(model: NorseTask, tmp_path: Path, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = quiet_trainer(callbacks, tmp_path, **kwargs)
    trainer.fit(model, _loader(), ckpt_path=ckpt_path)
    return trainer


def _close(a: NorseTask, b: NorseTask) -> None:
    torch.testing.assert_close(torch.stack(a.losses), torch.stack(b.losses), rtol=0, atol=1e-6)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("granularity", "budget"), [("stack", "60KiB"), ("auto", "60KiB")])
def test_norse_task_trains_as_its_own_loop(tmp_path: Path, granularity: str, budget: str) -> None:
    """Two epochs, two batches accumulated per optimizer step, gradients clipped: losses and
    weights equal Norse's loop trained the same way (float32 round-off)."""
    options = dict(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5)
    loop = NorseTask(wrapped=False)
    _fit(loop, tmp_path, [], **options)
    model = NorseTask(granularity=granularity)
    callback = MemoryBudget(budget, margin=0.0, verbose=False)
    trainer = _fit(model, tmp_path, [callback], **options)
    assert trainer.global_step == 4 and len(model.losses) == 8
    # the budget made it checkpoint (plain BPTT needs more than 60KiB): a stack plan or
    # layer-wise, whichever "auto" measured faster
    assert callback.plans["net"].describe() != "BPTT()"
    assert callback.measured_peak_bytes is not None
    assert callback.measured_peak_bytes <= parse_bytes(budget)
    _close(loop, model)


def test_a_resumed_fit_continues_as_the_uninterrupted_one(tmp_path: Path) -> None:
    """Resumed from the first epoch's ``ModelCheckpoint``: the plans come from the checkpoint
    (no probe), the second epoch trains as in one fit, and ``load_from_checkpoint`` gives an
    inference model (no callback) predicting as the trained module does."""
    budget = "60KiB"
    whole = NorseTask()
    _fit(whole, tmp_path / "whole", [MemoryBudget(budget, margin=0.0, verbose=False)], max_epochs=2)

    first = NorseTask()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    callback = MemoryBudget(budget, margin=0.0, verbose=False)
    _fit(first, tmp_path, [callback, saver], enable_checkpointing=True)
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    resumed, again = NorseTask(), MemoryBudget(budget, margin=0.0, verbose=False)
    _fit(resumed, tmp_path, [again], max_epochs=2, ckpt_path=str(checkpoint))
    assert again.planners["net"].probes == 0
    assert again.plans["net"].plan == callback.plans["net"].plan
    assert not isinstance(again.plans["net"].plan, BPTT)
    resumed.losses[:0] = first.losses
    _close(whole, resumed)

    inference = NorseTask.load_from_checkpoint(checkpoint).eval()
    with torch.no_grad():
        expected = first.eval()(_loader(1, seed=3).dataset[0][0])
    predictor = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    (predicted,) = predictor.predict(inference, _loader(1, seed=3))
    assert torch.equal(predicted, expected)
    # with the callback attached and no fit: nothing planned, the model's own tier put back
    callback = MemoryBudget(budget, storage="disk", verbose=False)
    predictor = pl.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[callback]
    )
    (predicted,) = predictor.predict(inference, _loader(1, seed=3))
    assert torch.equal(predicted, expected)
    assert not callback.planners and inference.net.storage != "disk"
