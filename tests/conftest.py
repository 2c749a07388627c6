"""Fixtures shared by every test module.

``make_tree("0.30.0")`` gives a fresh, writable copy of a real release,
``make_tree("0.30.0", reformatted=True)`` the reformatted copy, and
``cli(...)`` runs the real command line in-process and returns its result.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.releases import RELEASES, copy_tree, pristine_tree  # noqa: E402 - the checkout must be on sys.path first


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        return json.loads(self.stdout)

    def verdicts(self) -> dict[str, str]:
        return {p["id"]: p["verdict"] for p in self.json()["patches"]}

    def patch(self, patch_id: str) -> dict:
        """The JSON report of one patch."""
        (patch,) = [p for p in self.json()["patches"] if p["id"] == patch_id]
        return patch


def run_cli(*args: str) -> CliResult:
    from patch_dsv4.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def make_tree(tmp_path_factory):
    """Fresh writable copies of real releases, removed again after the test (5,000+ files each)."""
    made: list[Path] = []

    def make(version: str, reformatted: bool = False) -> Path:
        if reformatted:
            from tests.reformat import reformatted_tree

            source = reformatted_tree(version)
        else:
            source = pristine_tree(version)
        dest = tmp_path_factory.mktemp(f"vllm-{version}{'-ref' if reformatted else ''}")
        made.append(dest)
        return copy_tree(source, dest / "site-packages")

    yield make
    for dest in made:
        shutil.rmtree(dest, ignore_errors=True)


RELEASE_PARAMS = [pytest.param(v, id=f"vllm-{v}") for v in RELEASES]

# What fetches from pip's index on a cold cache: the fixtures (per test), and the helpers a module calls
# itself, in tests/releases.py or in the support modules built on them (then every test of the module).
WHEEL_FIXTURES = {"make_tree", "release_wheels"}
WHEEL_CALLS = re.compile(
    r"\b(pristine_tree|wheel|wheel_file|minimal_tree|install_flashinfer_sources|reformatted_tree|pip_fetch"
    r"|recipe_trees|miaai_trees|roundtrip|fake_runtime|refactor\.generator)\b"
)
_fetches: dict[str, bool] = {}


def pytest_collection_modifyitems(items):
    """Mark ``wheels`` on each test that needs release wheels or trees (pyproject.toml describes it)."""
    for item in items:
        path = str(item.path)
        if path not in _fetches:
            _fetches[path] = bool(WHEEL_CALLS.search(item.path.read_text(encoding="utf-8")))
        if _fetches[path] or WHEEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.wheels)


@pytest.fixture
def running(monkeypatch):
    """Make the serve guard see ``tree``'s vLLM as the one this process imported (``running(tree)``)."""
    import types

    from patch_dsv4 import guard

    def run_in(tree):
        module = types.ModuleType("vllm")
        module.__file__ = str(tree / "vllm" / "__init__.py")
        monkeypatch.setitem(sys.modules, "vllm", module)
        monkeypatch.setattr(guard, "_reported", False)

    return run_in
