"""The right verdicts from odd but valid files: evidence that differs from RECORD, dangling links,
encodings, BOMs and newlines."""

from __future__ import annotations

import codecs
from pathlib import Path

import pytest

from patch_dsv4.patches.loader_skips import MODEL
from patch_dsv4.patches.stream_load import VL_MODEL
from tests.releases import content_snapshot, rewrite_record, wheel_file


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
