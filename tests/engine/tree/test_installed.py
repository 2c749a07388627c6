"""The one reader of the installed tree (patch_dsv4.tree.installed) reads what the libraries it stands in for read:
importlib.metadata's distributions, csv's RECORD rows, packaging's names and requirements, on every release."""

from __future__ import annotations

import csv
import io
from importlib.metadata import distributions

import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from patch_dsv4.tree import installed
from tests.conftest import RELEASE_PARAMS
from tests.releases import pristine_tree


def _packaging_pin(requirements) -> str | None:
    """FlashInfer's pin as packaging reads a requirement list (what the engine read before): the first
    ``flashinfer-python`` requirement with a lone exact ``==`` whose marker holds with no extra; a wildcard
    version (``==0.6.*``) is no pin."""
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != "flashinfer-python":
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        specs = list(req.specifier)
        if len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version:
            return specs[0].version
    return None


REQUIREMENTS = [
    "flashinfer-python==0.6.18.post1",
    "flashinfer-python (==0.6.1)",
    "Flashinfer_Python == 0.7.3",
    "flashinfer.python==0.7.3",
    "flashinfer-python[jit]==0.7.3",
    "flashinfer-python==0.7.3; platform_machine == 'x86_64' or platform_machine == 'aarch64'",
    "flashinfer-python==0.7.3 ; sys_platform == 'win32'",
    "flashinfer-python==0.7.3; extra == 'flashinfer'",
    "flashinfer-python==0.7.3; python_version >= '3.9'",
    "flashinfer-python>=0.6",
    "flashinfer-python==0.6.*",
    "flashinfer-python===0.6.1",
    "flashinfer-python==0.6.1,>=0.5",
    "flashinfer-python @ https://example.invalid/flashinfer_python-0.6.1-py3-none-any.whl",
    "flashinfer-python==",
    "flashinfer-python==0.6.1; this is not a marker",
    "flashinfer-cubin==0.6.1",
    "flashinfer==0.2",
    "torch==2.9.0",
]


@pytest.mark.parametrize("requirement", REQUIREMENTS)
def test_the_pin_is_packagings(requirement):
    assert installed.flashinfer_pin([requirement]) == _packaging_pin([requirement])


@pytest.mark.parametrize("version", RELEASE_PARAMS)
def test_each_release_reads_as_importlib_csv_and_packaging_read_it(version):
    tree = pristine_tree(version)
    (dist,) = [d for d in distributions(path=[str(tree)]) if canonicalize_name(d.metadata["Name"]) == "vllm"]
    found = installed.find_dist("vllm", [tree], "vllm")
    assert (found.name, found.version, found.path) == ("vllm", dist.version, str(dist._path))
    assert found.requires() == dist.requires
    assert installed.flashinfer_pin(found.requires()) == _packaging_pin(dist.requires) is not None
    rows = list(csv.reader(io.StringIO((dist._path / "RECORD").read_text())))
    assert found.record() == {r[0]: r[1].partition("=")[2] for r in rows if r[1].startswith("sha256=")}
    assert {p: (a, d, s) for p, (a, d, s) in installed.read_record(found.path).items()} == {
        r[0]: (r[1].partition("=")[0], r[1].partition("=")[2], r[2]) for r in rows
    }


@pytest.mark.parametrize("name", ["vllm", "Flashinfer_Python", "flashinfer.python", "a--b__c..d", "A-B_C.D"])
def test_names_are_pep_503(name):
    assert installed.canonical(name) == canonicalize_name(name)


@pytest.mark.parametrize(
    "line",
    ['"a,b.py",sha256=abc,3', "x,,", '"q""x.py",sha256=abc,1', "../../bin/vllm,sha256=abc,22"],
)
def test_a_record_row_is_csvs(line):
    row = next(csv.reader([line]))
    assert installed._record_row(line) == (row[0], *row[1].partition("=")[::2], row[2])


def test_no_private_cpython_module_anywhere():
    """No module of the repository imports, looks up or names a private module of CPython's (``_json``, ``_sha2``,
    ``_hashlib``, ...): imports, ``__import__``/``import_module`` calls and ``sys.modules`` keys, all read from the
    code's syntax tree."""
    import ast
    import sys

    from tests.conftest import ROOT

    private = {name for name in sys.stdlib_module_names if name.startswith("_") and not name.startswith("__")}
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if any(part in (".venv", "build", "dist") or part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue
        tree = ast.parse(path.read_bytes(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]  # a name looked up in sys.modules, or given to __import__
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in private]
    assert found == []
