"""The sdist and the wheel people install: what they hold, and one version everywhere.

They are built once per run with ``python -m build`` (the sdist, then the wheel
from it, as the release workflow does), or read from ``$PATCH_DSV4_DIST`` where
.ci/package already built them. .ci/package also installs the wheel into a fresh
venv and runs the README's first command from it.
"""

from __future__ import annotations

import ast
import configparser
import os
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from tests.releases import cache_lock

ROOT = Path(__file__).resolve().parents[2]


def _package_dirs() -> dict[str, str]:
    """Installed package -> the repository folder it is built from (pyproject.toml's package-dir): patcher/ and
    every folder under it with an __init__.py (each must be in pyproject's packages list), patches/, anchors/."""
    found = {}
    for init in sorted((ROOT / "patcher").rglob("__init__.py")):
        folder = init.parent.relative_to(ROOT)
        found["/".join(("patch_dsv4", *folder.parts[1:]))] = folder.as_posix()
    return {**found, "patch_dsv4/patches": "patches", "patch_dsv4/anchors": "anchors"}


PACKAGE_DIRS = _package_dirs()


def _source_version() -> str:
    """``__version__`` as patcher/__init__.py sets it: the one place the version is written."""
    tree = ast.parse((ROOT / "patcher/__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("patcher/__init__.py sets no __version__")


@pytest.fixture(scope="session")
def dists(tmp_path_factory) -> tuple[Path, Path]:
    """(sdist, wheel) of this checkout."""
    given = os.environ.get("PATCH_DSV4_DIST")
    if given:
        out = Path(given)
    else:
        out = tmp_path_factory.mktemp("dist")
        with cache_lock("build-checkout"):  # one build at a time in the checkout (pytest -n: one per worker)
            built = subprocess.run(
                [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], capture_output=True, text=True
            )
        assert built.returncode == 0, f"python -m build failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
    sdists, wheels = sorted(out.glob("patch_dsv4-*.tar.gz")), sorted(out.glob("patch_dsv4-*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, f"expected one sdist and one wheel in {out}: {os.listdir(out)}"
    return sdists[0], wheels[0]


def _shipped(directory: str) -> set[str]:
    """The files of a package folder that installs must carry: its modules and JSON data."""
    return {p.name for p in (ROOT / directory).iterdir() if p.suffix in (".py", ".json") and p.is_file()}


def test_the_version_has_one_source():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"], "pyproject.toml must not set the version: patcher/__init__.py does"
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "patch_dsv4.__version__"}

    import patch_dsv4

    assert patch_dsv4.__version__ == _source_version()
    shown = subprocess.run([sys.executable, "-m", "patch_dsv4", "--version"], capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout == f"patch-dsv4 {_source_version()}\n", shown


def test_the_wheel_holds_the_package_its_data_and_entry_points(dists):
    _, wheel = dists
    version = _source_version()
    assert wheel.name == f"patch_dsv4-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = f"patch_dsv4-{version}.dist-info"
        metadata = Parser().parsestr(zf.read(f"{info}/METADATA").decode())
        entry_points = configparser.ConfigParser(delimiters="=")
        entry_points.optionxform = str
        entry_points.read_string(zf.read(f"{info}/entry_points.txt").decode())

    for package, directory in PACKAGE_DIRS.items():
        assert f"{package}/__init__.py" in names, package
        missing = {name for name in _shipped(directory) if f"{package}/{name}" not in names}
        assert not missing, f"the wheel lacks {sorted(missing)} of {directory}/"
    assert "patch_dsv4/report.schema.json" in names
    assert {n for n in names if n.startswith("patch_dsv4/anchors/")} >= {
        f"patch_dsv4/anchors/{p.name}" for p in (ROOT / "anchors").glob("vllm-*.json")
    }
    assert (ROOT / "anchors/vllm-0.30.0.json").exists()  # the README's release: the wheel must know it
    strays = {n for n in names if not n.startswith(("patch_dsv4/", f"{info}/"))}
    assert not strays, f"the wheel installs files outside patch_dsv4: {sorted(strays)}"

    assert metadata["Name"] == "patch-dsv4" and metadata["Version"] == version
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert dict(entry_points["console_scripts"]) == {"patch-dsv4": "patch_dsv4.cli:main"}
    assert dict(entry_points["vllm.general_plugins"]) == {"patch_dsv4": "patch_dsv4.guard:check"}


def test_the_sdist_holds_what_a_build_needs(dists):
    sdist, _ = dists
    version = _source_version()
    top = f"patch_dsv4-{version}"
    assert sdist.name == f"{top}.tar.gz"
    with tarfile.open(sdist) as tf:
        names = set(tf.getnames())
        pkg_info = Parser().parsestr(tf.extractfile(f"{top}/PKG-INFO").read().decode())
    for needed in ("pyproject.toml", "README.md", "PKG-INFO", "patcher/report.schema.json"):
        assert f"{top}/{needed}" in names, needed
    for directory in PACKAGE_DIRS.values():
        missing = {name for name in _shipped(directory) if f"{top}/{directory}/{name}" not in names}
        assert not missing, f"the sdist lacks {sorted(missing)} of {directory}/"
    assert pkg_info["Version"] == version
    assert not {n for n in names if "/.venv/" in n or "/.git/" in n or "__pycache__" in n}


@pytest.mark.slow
def test_the_sdist_carries_its_license_and_runs_its_tests(dists, tmp_path):
    sdist, wheel = dists
    top = f"patch_dsv4-{_source_version()}"
    with zipfile.ZipFile(wheel) as zf:
        info = f"patch_dsv4-{_source_version()}.dist-info"
        assert zf.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        assert Parser().parsestr(zf.read(f"{info}/METADATA").decode())["License-File"] == "LICENSE"
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")[:200]
    with tarfile.open(sdist) as tf:
        names = set(tf.getnames())
        tf.extractall(tmp_path, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    assert f"{top}/LICENSE" in names
    helpers = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")}
    missing = sorted(h for h in helpers if f"{top}/{h}" not in names)
    assert not missing, f"the sdist lacks the test files {missing}"

    # Every test module imports (its helpers are there), and a test file runs, from the unpacked sdist.
    unpacked = tmp_path / top
    for args in (["--collect-only", "-m", "not real_vllm"], ["tests/engine/patching/test_registry.py"]):
        ran = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
            cwd=unpacked,
            capture_output=True,
            text=True,
        )
        assert ran.returncode == 0, f"pytest {args} in the sdist:\n{ran.stdout[-3000:]}\n{ran.stderr[-2000:]}"
        assert "error" not in ran.stdout.lower().splitlines()[-1], ran.stdout[-2000:]
