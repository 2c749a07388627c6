"""verify's fast path: what it imports, and that it says what the typed report says, in every format."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import textwrap
from contextlib import redirect_stdout

import pytest

from patch_dsv4.fastpath import quick
from patch_dsv4.output import render
from patch_dsv4.output.verdicts import Report

#: Never imported by verify on an applied tree: the typed model (dataclasses, whose import pulls inspect),
#: typing, the full judgement and the libraries of the Typer app.
HEAVY = (
    "dataclasses",
    "inspect",
    "typing",
    "patch_dsv4.output.verdicts",
    "patch_dsv4.pipeline.commands",
    "patch_dsv4.tree.state",
    "patch_dsv4.app",
    "libcst",
    "typer",
    "rich",
    "packaging",
    "importlib.metadata",
)
FORMATS = [[], ["-q"], ["-v"], ["--json"], ["--format", "markdown"]]


def _fresh_verify(tree, *options: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """verify in a fresh interpreter, and the modules of HEAVY it imported."""
    probe = (
        "import sys; from patch_dsv4.cli import main; code = main(sys.argv[1:]);"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr); sys.exit(code)"
    )
    args = [sys.executable, "-c", probe, "verify", "--site-packages", str(tree), *options]
    result = subprocess.run(args, capture_output=True, text=True)
    return result, ast.literal_eval(result.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("options", FORMATS, ids=lambda o: " ".join(o) or "table")
def test_verify_on_an_applied_tree_imports_no_typed_model(options, make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    result, heavy = _fresh_verify(tree, *options)
    assert result.returncode == 0, result.stderr
    assert "hashes match the recorded state" in result.stdout  # the fast path answered
    assert heavy == []


def _rendered(document, fmt: str, verbosity: int) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        render.render(document, fmt, verbosity)
    return out.getvalue()


@pytest.mark.parametrize("opt_in", [[], ["--with", "dense-exl3"]], ids=["default", "dense-exl3"])
def test_the_fast_document_and_the_typed_report_say_the_same(opt_in, make_tree, cli):
    """What the fast path renders (a document) and the typed report of the same verdicts, in every format."""
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree, *opt_in).code == 0
    site = quick.locate([str(tree)])
    recorded = quick.recorded_verdicts(site)
    assert recorded is not None
    document = quick.recorded_document(site, recorded, f" --site-packages {tree}")
    report = quick.recorded_report(site, recorded, f" --site-packages {tree}")
    assert isinstance(report, Report) and report.to_json() == document
    assert Report.from_json(document) == report
    for fmt in ("table", "json", "markdown"):
        for verbosity in (-1, 0, 1):
            assert _rendered(document, fmt, verbosity) == _rendered(report, fmt, verbosity), (fmt, verbosity)


@pytest.mark.parametrize(
    "text",
    [
        "plain words",
        "  leading spaces",
        "trailing space ",
        "a\u00a0b",
        "ends in nbsp\u00a0",
        "tab\there",
        "new\nline",
        "x" * 70,
        "",
        "   ",
        "a  b   c",
        "\u2003em space",
    ],
)
@pytest.mark.parametrize("indent", ["", "  ", "      "])
def test_wrapping_a_line_that_fits_is_what_textwrap_gives(text, indent):
    expected = textwrap.wrap(
        text,
        width=60,
        initial_indent=indent,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [indent.rstrip()]
    assert render._wrap(text, 60, indent) == expected


def test_the_patch_digest_covers_every_module_that_judges_in_every_folder(tmp_path):
    """verify's fast path and the guard trust recorded verdicts only if the patch digest is what it was: a change
    to any module of the engine, in whichever folder it lies, or to any patch changes it; doctor's modules do not."""
    import shutil
    from pathlib import Path

    import patch_dsv4
    import patch_dsv4.patches

    package = tmp_path / "patch_dsv4"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(Path(patch_dsv4.__file__).parent, package, ignore=skip)
    shutil.copytree(Path(patch_dsv4.patches.__file__).parent, package / "patches", ignore=skip)
    probe = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import patch_dsv4; from patch_dsv4.fastpath import quick; "
        "from pathlib import Path; root = Path(patch_dsv4.__file__).parent; before = quick.patch_digest(); same = []\n"
        "for path in sorted(root.rglob('*.py')):\n"
        "    data = path.read_bytes(); path.write_bytes(data + b'\\n')\n"
        "    same += [path.relative_to(root).as_posix()] if quick.patch_digest() == before else []\n"
        "    path.write_bytes(data)\n"
        "print(same)"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    modules = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py"))
    doctor = [m for m in modules if m.startswith("doctor/")]
    assert doctor and len(modules) > len(doctor) + 20
    assert ast.literal_eval(run.stdout.strip()) == doctor
