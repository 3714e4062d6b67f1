"""Train a wrapped snnTorch network on SHD with a device memory budget (Lightning).

``MemoryBudget`` probes one step of the wrapped model at the first batch, picks the fastest
checkpointing plan that fits the budget, and measures the peak of a training step with
``spikeckpt.MemoryMeter``. The data are synthetic files in the real SHD format (written to a
temporary folder) unless ``--root`` points at the real ones. 15-25 s on 2 CPU cores, half of
it importing Lightning:

    python examples/lightning_shd.py
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import warnings

import lightning.pytorch as pl
import snntorch as snn
import torch
from torch import nn

import spikeckpt
from spikeckpt.data import SHDDataModule, write_synthetic_shd
from spikeckpt.lightning import MemoryBudget
from spikeckpt.planning import probe_model


class SHDClassifier(pl.LightningModule):
    """Classify by the output spike counts, summed inside the checkpointed loop."""

    def __init__(self, channels: int, hidden: int, classes: int) -> None:
        super().__init__()
        net = nn.Sequential(
            nn.Linear(channels, hidden),
            snn.Leaky(beta=0.95, learn_beta=True),
            nn.Linear(hidden, classes),
            snn.Leaky(beta=0.95),
        )
        self.net = spikeckpt.wrap(net, readout="sum")  # the callback sets the plan

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch  # x: (T, B, channels) spikes, time first; y: (B,)
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, batch_size=len(y))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=2e-3)


def main() -> None:
    # Small tensors: one thread is fastest, and on a busy machine two threads per process
    # fighting other jobs for the cores ran these examples 5-10 times slower.
    torch.set_num_threads(1)
    # Only this script's own lines: no Lightning start-up notes and tips (info level), nor a
    # deprecation warning that Lightning's own code triggers with recent torch.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="folder with SHD/ (default: a temporary folder)")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        if args.root is None:  # synthetic files in the real format, 40 training recordings
            write_synthetic_shd(tmp, samples=40)
        data = SHDDataModule(
            args.root or tmp,
            dt_us=10_000,  # 10 ms bins
            duration_us=1_000_000,  # every batch 1 s: T = 100 steps
            channels=140,  # merge 5 neighbouring channels of 700
            batch_size=16,
            # an explicit --root must hold the real files (DataNotFoundError says what is
            # missing otherwise)
            download=False,
            packed=True,  # batches are packed spike trains: 1 bit per element or less
        )
        data.prepare_data()
        data.setup("fit")
        model = SHDClassifier(data.channels, hidden=32, classes=data.num_classes)

        # A budget of a third of what plain BPTT needs for the activations, plus what a step
        # holds besides: the model, its gradients, Adam's two moments, the engine's gradient
        # buffers, the packed input train and one step's working memory. In practice:
        # MemoryBudget("2GiB"); a budget too small is refused naming the smallest that works.
        x, _ = next(iter(data.train_dataloader()))  # a packed SpikeTrain (T, B, channels)
        probe = probe_model(model.net, x, model.net.initial_state(x.step(0)), "host")
        bptt = probe.state_bytes + x.shape[0] * probe.step_bytes
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        fixed = 6 * params + x.nbytes + probe.work_bytes
        callback = MemoryBudget(fixed + bptt // 3, storage="host", verbose=False)

        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=args.epochs,
            callbacks=[callback],
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
            default_root_dir=tmp,
        )
        trainer.fit(model, train_dataloaders=data.train_dataloader())  # no validation here
        source = "synthetic" if data.is_synthetic else "real"
        recordings = len(data.train_set) + len(data.val_set)

    fmt = spikeckpt.format_bytes
    print(
        f"SHD ({source} files): {recordings} training recordings, T={data.T} steps of 10 ms, "
        f"{data.channels} channels"
    )
    print(
        f"device budget for a training step: {fmt(callback.total_bytes)}; for the wrapped "
        f"model's steps, after the model, gradients, Adam and a 5% margin: "
        f"{fmt(callback.budget_bytes)} (plain BPTT's activations, estimated: {fmt(bptt)})"
    )
    # One plan per (T, batch) shape: the last, smaller batch of an epoch gets its own.
    print("plans chosen, callback.planners['net'].choices:")
    choices = callback.planners["net"].choices
    for _, per_shape in sorted(choices.items(), key=lambda item: (item[0][0], -item[0][1])):
        print(f"  {per_shape.summary()}")
    # callback.plans: wrapped module name -> the latest PlanChoice (the last batch's shape)
    print(f"callback.plans['net'] (the last batch's): {callback.plans['net'].describe()}")
    print(f"measured peak of the first training step: {fmt(callback.measured_peak_bytes)}")


if __name__ == "__main__":
    main()
