"""No traceback, ever, on bad input; and the right verdicts from odd but valid files.

Every case is one line on stderr with exit 2 (the environment cannot be
used), or a report that names the odd file instead of judging from it.
"""

from __future__ import annotations

import codecs
import json
import shutil
from pathlib import Path

import pytest

from patch_dsv4.patches.loader_skips import MODEL
from patch_dsv4.patches.stream_load import VL_MODEL
from tests.errors import error_lines
from tests.releases import content_snapshot, rewrite_record, stat_snapshot, wheel_file


def _error(result, *words) -> str:
    assert result.code == 2, (result.code, result.stdout, result.stderr)
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _dist_info(tree: Path) -> Path:
    (found,) = tree.glob("vllm-*.dist-info")
    return found


# -- damaged metadata ------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["record-not-utf8", "record-huge-field", "metadata-not-utf8"])
def test_damaged_record_or_metadata(damage, make_tree, cli):
    tree = make_tree("0.30.0")
    dist = _dist_info(tree)
    if damage == "record-not-utf8":
        (dist / "RECORD").write_bytes(b"\xff\xfe" + (dist / "RECORD").read_bytes())
    elif damage == "record-huge-field":
        (dist / "RECORD").write_text("vllm/x.py,sha256=" + "A" * 300_000 + ",1\n")
    else:
        (dist / "METADATA").write_bytes((dist / "METADATA").read_bytes() + b"\nSummary: \xff\xfe\n")
    before = stat_snapshot(tree)
    for command in ("status", "verify", "apply", "revert"):
        _error(cli(command, "--site-packages", tree), "vllm")
    assert stat_snapshot(tree) == before


def test_two_dist_infos_that_match_equally_well(make_tree, cli):
    tree = make_tree("0.30.0")
    dist = _dist_info(tree)
    other = tree / "vllm-0.31.0.dist-info"
    shutil.copytree(dist, other)
    meta = other / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 0.30.0", "Version: 0.31.0", 1))
    line = _error(cli("status", "--site-packages", tree), "0.30.0", "0.31.0", "equally well")
    assert "dist-info" in line


# -- odd targets ---------------------------------------------------------------------
@pytest.mark.parametrize("odd", ["directory", "link-loop"])
def test_target_that_is_a_directory_or_a_link_loop(odd, make_tree, cli):
    tree = make_tree("0.30.0")
    target = tree / VL_MODEL
    target.unlink()
    if odd == "directory":
        target.mkdir()
    else:
        loop = target.with_name("loop.py")
        loop.symlink_to(target.name)
        target.symlink_to(loop.name)
    before = stat_snapshot(tree)
    for command in ("status", "verify", "apply"):
        _error(cli(command, "--site-packages", tree), VL_MODEL)
    assert stat_snapshot(tree) == before


def test_state_entry_naming_a_huge_file_is_never_read_whole(make_tree, cli):
    """A 4 GiB file where the state expects ours: not ours, never read whole, one line."""
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    target = tree / VL_MODEL
    target.unlink()
    with open(target, "wb") as fh:
        fh.truncate(4 << 30)  # sparse: 4 GiB of size, no disk
    try:
        status = cli("status", "--site-packages", tree)
        _error(status, VL_MODEL, "bytes")
        assert cli("revert", "--site-packages", tree).code == 1  # modified since we wrote it: kept
        assert target.stat().st_size == 4 << 30
    finally:
        target.unlink()


# -- bad options ---------------------------------------------------------------------------
def test_python_that_is_not_python(cli):
    _error(cli("status", "--python", "/usr/bin/true"), "not a Python interpreter")
    _error(cli("status", "--python", "/etc/passwd"), "cannot run")


def test_path_component_over_the_os_limit(tmp_path, cli):
    _error(cli("status", "--site-packages", tmp_path / ("x" * 300)))
    _error(cli("drift", "--source", tmp_path / ("x" * 300)))


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_lock_timeout_must_be_a_finite_number(value, make_tree, cli):
    tree = make_tree("0.30.0")
    before = stat_snapshot(tree)
    for command in ("apply", "revert"):
        _error(cli(command, "--site-packages", tree, "--lock-timeout", value), "--lock-timeout")
    assert stat_snapshot(tree) == before


def test_internal_error_is_one_line_exit_2(make_tree, cli, monkeypatch):
    from patch_dsv4.pipeline import judge

    def broken(*_args, **_kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(judge, "judge", broken)
    tree = make_tree("0.30.0")
    line = _error(cli("status", "--site-packages", tree), "internal error", "ZeroDivisionError", "report")
    assert "bug" in line


# -- right verdicts from odd but valid files ---------------------------------------------
def test_evidence_file_that_differs_from_record_decides_nothing(make_tree, cli):
    """A 0-byte vl_model.py on 0.30.0 must not turn loader-skips from upstream into pending."""
    tree = make_tree("0.30.0")
    (tree / VL_MODEL).unlink()
    (tree / VL_MODEL).write_bytes(b"")
    before = content_snapshot(tree)
    status = cli("status", "--site-packages", tree, "--json")
    assert status.code == 0
    loader = status.patch("loader-skips")
    assert loader["verdict"] == "drifted" and "cannot be judged" in loader["detail"] and VL_MODEL in loader["detail"]
    assert status.patch("stream-load")["verdict"] == "drifted"
    refused = cli("apply", "--site-packages", tree)
    assert refused.code == 1 and "RECORD" in refused.stderr and "--force" in refused.stderr
    assert content_snapshot(tree) == before
    assert (tree / MODEL).read_bytes() == wheel_file("0.30.0", MODEL)


def test_dangling_evidence_link_is_reported(make_tree, cli):
    tree = make_tree("0.30.0")
    (tree / VL_MODEL).unlink()
    (tree / VL_MODEL).symlink_to("nowhere.py")
    status = cli("status", "--site-packages", tree, "--json")
    assert status.code == 0
    loader = status.patch("loader-skips")
    assert loader["verdict"] == "drifted" and "leads nowhere" in loader["detail"]


def _rewrite(tree: Path, relpath: str, data: bytes) -> None:
    path = tree / relpath
    path.unlink()
    path.write_bytes(data)
    rewrite_record(tree, [relpath])


def _changed_lines(old: bytes, new: bytes) -> tuple[list[bytes], list[bytes]]:
    import difflib

    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    removed, added = [], []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op != "equal":
            removed += a[i1:i2]
            added += b[j1:j2]
    return removed, added


@pytest.mark.parametrize("form", ["crlf", "bom", "latin-1"])
def test_source_keeps_its_encoding_bom_and_newlines(form, make_tree, cli):
    tree = make_tree("0.30.0")
    original = wheel_file("0.30.0", VL_MODEL)
    if form == "crlf":
        data = original.replace(b"\n", b"\r\n")
    elif form == "bom":
        data = codecs.BOM_UTF8 + original
    else:
        text = original.decode("utf-8")
        data = ("# -*- coding: latin-1 -*-\n# caf\u00e9\n" + text).encode("latin-1", "backslashreplace")
    _rewrite(tree, VL_MODEL, data)
    assert cli("status", "--site-packages", tree, "--json").patch("stream-load")["verdict"] == "pending"
    assert cli("apply", "--site-packages", tree, "--only", "stream-load").code == 0
    patched = (tree / VL_MODEL).read_bytes()
    removed, added = _changed_lines(data, patched)
    assert [line.strip() for line in removed] == [b"mapped = iter(sorted(mapped, key=lambda x: x[0]))"]
    assert any(b"_patch_dsv4_stream_language_model_first(mapped)" in line for line in added)
    if form == "crlf":
        assert patched.count(b"\n") == patched.count(b"\r\n")
    elif form == "bom":
        assert patched.startswith(codecs.BOM_UTF8) and not patched[3:].startswith(codecs.BOM_UTF8)
    else:
        assert "caf\u00e9".encode("latin-1") in patched and "caf\u00e9".encode() not in patched
    assert cli("verify", "--site-packages", tree).code in (0, 1)
    assert cli("revert", "--site-packages", tree).code == 0
    assert (tree / VL_MODEL).read_bytes() == data


def test_drift_source_reads_an_undecodable_file_as_present(make_tree, cli):
    tree = make_tree("0.30.0")
    _rewrite(tree, VL_MODEL, wheel_file("0.30.0", VL_MODEL) + b"\n# \xff\xfe not utf-8\n")
    data = cli("drift", "--source", tree, "--json").json()
    stream = [p for p in data["patches"] if p["id"] == "stream-load"][0]
    assert stream["verdict"] == "drifted" and "not readable Python source" in stream["detail"]


# -- verify's fast path ---------------------------------------------------------------------
def test_verify_fast_path_is_keyed_by_the_patch_definitions(make_tree, cli, monkeypatch):
    from patch_dsv4.fastpath import quick

    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    fast = cli("verify", "--site-packages", tree, "--json")
    assert fast.code == 0 and "hashes match" in fast.json()["summary"]
    monkeypatch.setattr(quick, "patch_digest", lambda: "another definition of the patches")
    slow = cli("verify", "--site-packages", tree, "--json")
    assert slow.code == 0 and "hashes match" not in slow.json()["summary"]


@pytest.mark.parametrize("forged", ["empty", "upstream-everywhere"])
def test_forged_state_cannot_make_verify_pass_on_an_unpatched_tree(forged, make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    assert cli("revert", "--site-packages", tree).code == 0
    assert cli("apply", "--site-packages", tree).code == 0
    manifest = tree / ".patch-dsv4" / "manifest.json"
    data = json.loads(manifest.read_text())
    for relpath in list(data["files"]):  # put the release's own files back behind the state's back
        (tree / relpath).unlink()
        (tree / relpath).write_bytes(wheel_file("0.30.0", relpath))
    data["files"] = {}
    if forged == "upstream-everywhere":
        import hashlib

        for verdict in data["verdicts"].values():
            verdict["verdict"] = "upstream"
        data["inputs"] = {  # a file the judgement found absent stays recorded as absent (None)
            rel: hashlib.sha256((tree / rel).read_bytes()).hexdigest() if (tree / rel).exists() else None
            for rel in data["inputs"]
        }
    manifest.write_text(json.dumps(data))
    result = cli("verify", "--site-packages", tree, "--json")
    assert result.code == 1, result.stdout
    assert result.verdicts()["stream-load"] == "pending"
