"""verify's fast path: what it imports, and that it says what the typed report says, in every format."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import textwrap
from contextlib import redirect_stdout

import pytest

from patch_dsv4 import quick, render
from patch_dsv4.verdicts import Report

#: Never imported by verify on an applied tree: the typed model (dataclasses, whose import pulls inspect),
#: typing, the full judgement and the libraries of the Typer app.
HEAVY = (
    "dataclasses",
    "inspect",
    "typing",
    "patch_dsv4.verdicts",
    "patch_dsv4.commands",
    "patch_dsv4.state",
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
