"""Code blocks in the docs and README run, so they cannot rot.

Every block fenced as ```python in README.md and docs/**/*.md is executed; blocks of one file
share a namespace, in order. Fence a block as ```text (or anything but python) to show code
that is not meant to run here.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
PAGES = [
    page
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    if BLOCK.search(page.read_text())
]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = BLOCK.findall(page.read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # snippets' temp folders land here
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for number, block in enumerate(blocks, 1):
        code = compile(block, f"{page.name}:block{number}", "exec")
        exec(code, namespace)  # noqa: S102 - documentation snippets are ours
