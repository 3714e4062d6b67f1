"""A Lightning ``Trainer`` for tests: on the CPU, one epoch, no logger, checkpoints, progress
bar or model summary unless asked for (``tests/test_lightning*.py``, ``test_outer_compile``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl


def quiet_trainer(callbacks: list[Any], root: Path | None = None, **options: Any) -> pl.Trainer:
    """``pl.Trainer(callbacks=callbacks, default_root_dir=root, ...)``; ``options`` override the
    quiet defaults."""
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    settings.update(options)
    return pl.Trainer(callbacks=callbacks, **settings)
