"""Code blocks in the docs and README run, so they cannot rot.

Every block fenced as ```python in README.md and docs/**/*.md is executed; blocks of one file
share a namespace, in order. Fence a block as ```text (or anything but python) to show code
that is not meant to run here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
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


# ------------------------------------------------------------------- the built site, the rules

#: A Sphinx role (``:class:`X```): mkdocstrings shows it as raw text. Cross-references are
#: written ``[`X`][spikeckpt.module.X]`` (a link where X is in the API reference).
ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`")
HAVE_MKDOCS = importlib.util.find_spec("mkdocs") is not None


def test_docstrings_use_one_cross_reference_syntax() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "spikeckpt").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ROLE.search(line)
    ]
    assert not found, f"Sphinx roles (write [`Name`][spikeckpt.path.Name]): {found}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation site, built as CI builds it (strict: an unresolved link fails)."""
    if not HAVE_MKDOCS:
        pytest.skip("needs mkdocs (the dev extra)")
    folder = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


def test_api_reference_renders_cross_references_as_links(site: Path) -> None:
    pages = sorted((site / "api").rglob("*.html"))
    assert len(pages) >= 7
    raw = {str(p.relative_to(site)): len(ROLE.findall(p.read_text())) for p in pages}
    assert sum(raw.values()) == 0, raw
    links = sum(p.read_text().count('class="autorefs autorefs-internal"') for p in pages)
    assert links >= 100, links  # 38 before the roles became links
    page = (site / "api" / "spikeckpt" / "index.html").read_text()
    assert 'href="../storage/#spikeckpt.storage.spiketrain.SpikeTrain"><code>SpikeTrain' in page


def _prose(text: str) -> str:
    """Markdown without code blocks, inline code and link targets."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)]*\)|\]\[[^\]]*\]", "]", text)


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_read_as_a_newcomer_needs(page: Path) -> None:
    text = page.read_text()
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert not [h for h in headings if re.search(r"\b[Ii]ssue\b|#\d", h)], headings
    prose = _prose(text)
    pages = re.findall(r"(?<![\w/.-])[\w/.-]+\.md\b", prose)
    assert not pages, f"file names that should be links: {pages}"
    if page.name != "benchmarks.md":  # measurement conditions live there
        anecdote = re.search(r"\bload\b[^.\n]{0,20}\d|\bbusy\b|other jobs|idle cores", prose)
        assert anecdote is None, anecdote.group(0) if anecdote else ""


def test_one_test_time() -> None:
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "index.md").read_text()
    times = re.findall(r"tests \((\d+-\d+ minutes) on 2 CPU cores", readme + index, re.I)
    assert len(times) == 2 and len(set(times)) == 1, times


@pytest.mark.parametrize("name", ["index.md", "wrapping.md"])
def test_where_to_see_the_chosen_plan(name: str) -> None:
    text = (ROOT / "docs" / name).read_text()
    assert "seq.last_stats.plan" in _prose(text).replace("]", "") or "`seq.last_stats.plan`" in text
    assert "print(seq.last_stats.plan)" in text  # and a block that runs it
