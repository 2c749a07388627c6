"""What a newcomer meets first (issue 40): --with, list, interrupts, hand edits outside a patch, write failures,
one error layout, drift's and status's lines, and every human line within 80 columns."""

from __future__ import annotations

import re

from tests.errors import error_lines

OPT_INS = "aux-streams, dense-exl3, exl3-wo-a-slices"


# -- 1. --with takes opt-ins only, as PATCH_DSV4_WITH does --------------------------------------
def test_with_a_default_patch_is_refused_naming_what_with_is_for(make_tree, cli, monkeypatch):
    tree = make_tree("0.30.0")
    result = cli("apply", "--site-packages", tree, "--with", "stream-load", "--dry-run")
    assert result.code == 2 and result.stdout == ""
    (line,) = error_lines(result.stderr)
    assert line.startswith("patch-dsv4: error: --with stream-load: stream-load is no opt-in patch: apply applies")
    assert f"opt-in patches only ({OPT_INS})" in line
    # the next command is the one given, without what was refused: it works as it stands
    assert line.endswith(f"(next: patch-dsv4 apply --site-packages {tree} --dry-run)")
    assert cli("apply", "--site-packages", tree, "--dry-run").code == 0
    # PATCH_DSV4_WITH says the same of the same id
    monkeypatch.setenv("PATCH_DSV4_WITH", "stream-load,aux-streams")
    env = cli("verify", "--site-packages", tree)
    (line,) = error_lines(env.stderr)
    assert env.code == 2 and "PATCH_DSV4_WITH=stream-load,aux-streams: stream-load is no opt-in patch" in line
    assert line.endswith(f"(next: PATCH_DSV4_WITH=aux-streams patch-dsv4 verify --site-packages {tree})")


def test_with_an_unknown_id_lists_only_the_opt_ins(make_tree, cli):
    tree = make_tree("0.30.0")
    result = cli("apply", "--site-packages", tree, "--with=aux-streams", "--with", "nonexistent", "-q")
    assert result.code == 2
    (line,) = error_lines(result.stderr)
    assert f"no opt-in patch nonexistent: the opt-in patches are {OPT_INS} " in line
    assert "stream-load" not in line and "wide-swa" not in line
    assert line.endswith(f"(next: patch-dsv4 apply --site-packages {tree} --with=aux-streams -q)")


# -- 2. list: one screen; the prose on asking ---------------------------------------------------
def test_list_is_a_line_a_patch_and_the_prose_on_asking(cli):
    from patch_dsv4.patching.registry import discover_patches

    patches = discover_patches()
    lines = cli("list").stdout.splitlines()
    assert len(lines) == len(patches) + 1 and all(len(line) <= 80 for line in lines), lines
    for patch, line in zip(patches, lines, strict=False):
        assert re.match(rf"{re.escape(patch.id)} +{'opt-in' if patch.opt_in else 'default'} +\S", line), line
    assert lines[-1] == "list: 7 patches, 3 opt-in; what each fixes and why: patch-dsv4 list ID (or -v)"
    one = cli("list", "wide-swa")
    prose = one.stdout.splitlines()
    assert one.code == 0 and prose[0].startswith("wide-swa: SM120 prefill")
    assert all(len(line) <= 80 for line in prose) and "Fixed upstream in FlashInfer 0.7.0" in one.stdout
    assert "aux-streams" not in one.stdout
    verbose = cli("list", "-v").stdout
    assert all(len(line) <= 80 for line in verbose.splitlines())
    assert all(f"{p.id}: " in verbose for p in patches) and "use it: patch-dsv4 apply --with aux-streams" in verbose
    unknown = cli("list", "nope")
    assert unknown.code == 2 and "no patch nope: the patches are aux-streams, " in error_lines(unknown.stderr)[0]


def test_list_prose_takes_the_terminal_width():
    from patch_dsv4.output.render import Style, why_lines
    from patch_dsv4.patching.registry import discover_patches

    rows = [(p.id, p.opt_in, p.title, p.why(), p.files()) for p in discover_patches()]
    for width in (60, 120):
        lines = why_lines(rows, Style(width))
        assert max(len(line) for line in lines) <= width
        assert max(len(line) for line in lines) > width - 10  # wrapped to the width, not to 80


# -- 6. one error layout ------------------------------------------------------------------------
def test_every_error_is_what_why_next_on_lines_of_their_own_within_80_columns(make_tree, cli):
    tree = make_tree("0.30.0")
    refused = cli("apply", "--site-packages", tree, "--with", "stream-load")
    failed = cli("verify", "--site-packages", tree)
    usage = cli("statu")
    for result in (refused, failed, usage):
        lines = result.stderr.splitlines()
        assert lines and all(len(line) <= 80 for line in lines), result.stderr
        assert all(re.match(r"patch-dsv4: (error|why|next|  )", line) for line in lines), result.stderr
        assert any(line.startswith("patch-dsv4: next: patch-dsv4 ") for line in lines), result.stderr
    assert "run:" not in failed.stderr
    assert error_lines(failed.stderr) == [
        "patch-dsv4: error: stream-load is pending in common/vl_model.py and 2 more files",
        "patch-dsv4: error: wide-swa is pending in nvidia/flashinfer_sparse.py and 1 more file"
        f" (next: patch-dsv4 apply --site-packages {tree})",
    ]
