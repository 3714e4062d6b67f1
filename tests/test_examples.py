"""Every script in examples/ runs end to end on synthetic data in under a minute, quietly.

They run as a user runs them (no thread settings from here): each example sets one torch
thread itself, which keeps it fast on a busy machine. Quiet: an example prints only its own
lines (nothing on stderr: no library banners, tips or warnings) and names plans as their
``repr``, whole.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT_S = 60

# What each example must print (a new example needs an entry here).
EXPECTED: dict[str, list[str]] = {
    "custom_step.py": ["scan peak:", "Revolve(slots=16)", "max |grad diff| vs the plain loop: 0"],
    "disk_tier.py": [
        "/checkpoints.bin holds ",
        "after backward: 0 files or folders left",
        "Double(remote_interval=100, local_interval=10)",
        "completed: True",
    ],
    "lightning_shd.py": [
        "SHD (synthetic files): 40 training recordings, T=100",
        "callback.plans['net']",
        "  Uniform(interval=25) for T=100, B=16: modeled peak",
        "measured peak of the first training step:",
    ],
    "norse_wrap.py": [
        "wrapped, Double(remote_interval=50, local_interval=10):",
        "max gradient difference",
    ],
    "plan_table.py": ["T = 10,000 steps", "Revolve(slots=498)", "Double(remote_interval=42,"],
    "snntorch_tutorial5.py": [
        "tutorial 5: 784-1000-10, 25 steps, batch 128",
        "layer-wise(chunk=5), neurons: ['fused', 'fused']",
        "output spikes equal to the loop's: True",
    ],
    "snntorch_wrap.py": ["wrapped, Revolve(slots=8):", "max gradient difference"],
}
NEEDS = {
    "lightning_shd.py": ("lightning", "snntorch", "tonic"),
    "norse_wrap.py": ("norse",),
    "snntorch_tutorial5.py": ("snntorch",),
    "snntorch_wrap.py": ("snntorch",),
}


def test_every_example_is_listed() -> None:
    assert sorted(EXPECTED) == [path.name for path in EXAMPLES]


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda path: path.name)
def test_examples_with_tensors_use_one_thread(script: Path) -> None:
    text = script.read_text()
    if "import torch" in text:
        assert "torch.set_num_threads(1)" in text, script.name


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda path: path.name)
def test_example_runs(script: Path, tmp_path: Path) -> None:
    for module in NEEDS.get(script.name, ()):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for text in EXPECTED[script.name]:
        assert text in result.stdout, (text, result.stdout)
    assert result.stderr == "", result.stderr  # only its own lines, on stdout
