"""The repository's promises: README commands match CI, the CLI answers, the package layers."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_readme_has_the_two_quick_start_commands() -> None:
    commands = _readme_commands()
    assert len(commands) >= 2
    assert 'pip install -e ".[all]"' in commands[0]
    assert commands[1].endswith('pip install -e ".[all,dev]" && pytest')


def test_ci_runs_the_readme_install_and_test_commands() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    install, test = commands = _readme_commands()[1].split(" && ")[-2:]
    assert install in ci.splitlines(), commands
    assert test in ci.splitlines(), commands
    assert "ruff check ." in ci and "ruff format --check ." in ci


def test_cli_plan_prints_a_plan_and_fails_clearly_when_nothing_fits() -> None:
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "spikeckpt",
            "plan",
            "--T",
            "1000",
            "--budget",
            "64KiB",
            "--state-bytes",
            "1KiB",
            "--step-bytes",
            "1KiB",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert "chosen:" in ok.stdout
    small = subprocess.run(
        [
            sys.executable,
            "-m",
            "spikeckpt",
            "plan",
            "--T",
            "1000",
            "--budget",
            "2KiB",
            "--state-bytes",
            "1KiB",
            "--step-bytes",
            "1KiB",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert small.returncode == 3
    # the one account: 2 states and a tape (3072 bytes) and the state's carried gradient
    assert "smallest budget that fits is 4096 bytes" in small.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "spikeckpt",
            "plan",
            "--T",
            "10",
            "--budget",
            "lots",
            "--state-bytes",
            "1",
            "--step-bytes",
            "1",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert "cannot parse 'lots'" in bad.stderr


def test_plan_table_example_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plan_table.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "T = 10,000 steps" in out and "Revolve" in out


def _imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names (absolute form)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_the_command_line_is_one_package_on_top() -> None:
    package = ROOT / "spikeckpt"
    old = ["cli.py", "cli_demo.py", "cli_plan.py", "cli_bench.py", "demo.py", "data/cli.py"]
    assert not [name for name in old if (package / name).exists()]
    assert {p.name for p in (package / "cli").glob("*.py")} >= {
        "__init__.py", "demo.py", "plan.py", "bench.py", "data.py"
    }  # fmt: skip
    offenders = []
    for path in package.rglob("*.py"):
        if "cli" in path.relative_to(package).parts[:1] or path.name == "__main__.py":
            continue
        if any(
            m == "spikeckpt.cli" or m.startswith("spikeckpt.cli.") for m in _imported_modules(path)
        ):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"only the command line may import spikeckpt.cli: {offenders}"


def test_readme_says_how_long_the_quick_start_takes() -> None:
    quick = (ROOT / "README.md").read_text().split("## Quick start")[1].split("\n## ")[0]
    flat = " ".join(quick.split())
    assert re.search(r"install took \d+:\d\d", flat), "the install time"
    assert re.search(r"about [\d.]+ GB", flat), "the download size"
    assert re.search(r"demo took \d+:\d\d", flat), "the demo time"
    assert re.search(r"tests \(\d+-\d+ minutes", flat), "the test time"
