"""Every ``>>>`` example in the package's docstrings runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from types import ModuleType

import pytest

import spikeckpt

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(spikeckpt.__path__, "spikeckpt.")
    if not info.name.endswith("__main__")
)


def _examples(module: ModuleType) -> list[doctest.DocTest]:
    tests = doctest.DocTestFinder().find(module, module.__name__)
    return [t for t in tests if t.examples]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in _examples(module):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (see above)"


def test_some_modules_have_examples() -> None:
    counted = sum(len(_examples(importlib.import_module(name))) for name in MODULES)
    assert counted >= 5, "the docstring examples were not found"
