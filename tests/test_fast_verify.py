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
from patch_dsv4.patches.stream_load import VL_MODEL

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
    "patch_dsv4.patching.evaluate",  # the probes' evaluator: judging only, never verify's fast path
    "patch_dsv4.patching.follow",
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


# -- stat keys: apply records what it found each file to be; a key found again vouches for the sha256 ------------
def _hashed(monkeypatch) -> list[str]:
    """The files the fast path reads and hashes in this process, from now on (an absent one is not read)."""
    read: list[str] = []
    real = quick._hash_file

    def hash_file(path):
        found = real(path)
        read.extend([path] if found[0] is not None else [])
        return found

    monkeypatch.setattr(quick, "_hash_file", hash_file)
    return read


def _keyed(tree) -> list[str]:
    """The files the fast path hashes on ``tree``'s state that are there (the ones apply can key)."""
    record = quick.anchors_record(quick.locate([str(tree)]).vllm_version)
    return [rel for rel in quick.keyed_files(quick.read_manifest(str(tree)), record) if (tree / rel).is_file()]


def _rewrite_in_place(path, data: bytes) -> None:
    """Write ``data`` into the file itself (same inode), then set its times back as they were: only ctime moves."""
    import os

    before = os.stat(path)
    with open(path, "r+b") as fh:
        fh.write(data)
        fh.truncate()
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


def _one_byte_changed(data: bytes) -> bytes:
    """``data`` with one letter of a comment changed: the same size, other bytes."""
    at = data.index(b"# ") + 2
    return data[:at] + (b"X" if data[at : at + 1] != b"X" else b"Y") + data[at + 1 :]


def test_apply_keys_every_file_the_fast_path_hashes_and_verify_then_reads_none(make_tree, cli, monkeypatch):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    keys = quick.read_stat_keys(str(tree))
    assert sorted(keys) == _keyed(tree) and len(keys) > 20
    for rel, (key, sha) in keys.items():
        assert (
            key == quick.stat_key((tree / rel).stat())
            and sha == quick.file_sha256()((tree / rel).read_bytes()).hexdigest()
        )
    read = _hashed(monkeypatch)
    assert quick.recorded_verdicts(quick.locate([str(tree)])) is not None
    assert read == []
    result = cli("verify", "--site-packages", tree)
    assert result.code == 0 and "hashes match the recorded state" in result.stdout and read == []


@pytest.mark.parametrize("change", ["same-bytes", "one-byte", "mtime-only"])
def test_a_file_changed_in_place_keeping_size_and_mtime_is_read_again(change, make_tree, cli, monkeypatch):
    """Right after apply, in place (same inode), the same size, the mtime set back: only ctime tells, and it does.
    The same bytes again (or a touch) keep the verdict; another byte is caught, by the fast path and in full."""
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    path = tree / VL_MODEL
    data = path.read_bytes()
    if change == "mtime-only":
        import os

        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        _rewrite_in_place(path, data if change != "one-byte" else _one_byte_changed(data))
    read = _hashed(monkeypatch)
    recorded = quick.recorded_verdicts(quick.locate([str(tree)]))
    assert read == [str(path)]  # that file alone is read: every other key still holds
    result = cli("verify", "--site-packages", tree, "--json")
    if change == "one-byte":
        assert recorded is None
        assert result.code == 1 and result.verdicts()["stream-load"] == "modified", result.stdout
    else:
        assert recorded is not None
        assert result.code == 0 and "hashes match the recorded state" in result.json()["summary"]


def test_a_copied_tree_is_hashed_and_judged_the_same(make_tree, cli, monkeypatch, tmp_path):
    """Another inode for every file copied: the keys do not hold there, the files are read; the verdicts are the
    same, and a one-byte edit in the copy (size and mtime kept) is caught."""
    import shutil

    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    copy = shutil.copytree(tree, tmp_path / "copy" / "site-packages", symlinks=True)  # cp -a: times kept
    read = _hashed(monkeypatch)
    here, there = (quick.recorded_verdicts(quick.locate([str(t)])) for t in (tree, copy))
    assert here is not None and there is not None and here.verdicts == there.verdicts and here.files == there.files
    assert str(copy / VL_MODEL) in read and not any(p.startswith(str(tree)) for p in read)
    assert cli("verify", "--site-packages", copy).code == 0
    _rewrite_in_place(copy / VL_MODEL, _one_byte_changed((copy / VL_MODEL).read_bytes()))
    assert quick.recorded_verdicts(quick.locate([str(copy)])) is None
    assert cli("verify", "--site-packages", copy, "--json").verdicts()["stream-load"] == "modified"


@pytest.mark.parametrize("keys", ["none", "unreadable", "another-format", "a-bad-entry"])
def test_a_state_without_usable_stat_keys_has_every_file_hashed(keys, make_tree, cli, monkeypatch):
    """A state written before stat keys (none), or keys this version cannot read: every file is read, the
    verdicts are the same, and a one-byte edit is caught; an entry that is not what apply writes is passed over."""
    import json

    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    sidecar = tree / ".patch-dsv4" / quick.STAT_KEYS
    document = json.loads(sidecar.read_text())
    if keys == "none":
        sidecar.unlink()
    elif keys == "unreadable":
        sidecar.write_text("{not json")
    elif keys == "another-format":
        sidecar.write_text(json.dumps({**document, "format": quick.STAT_KEYS_FORMAT + 1}))
    else:
        for entry in document["files"].values():
            entry[4] = float(entry[4])  # a ctime read back as a float: no longer exact
        sidecar.write_text(json.dumps(document))
    assert quick.read_stat_keys(str(tree)) == {}
    read = _hashed(monkeypatch)
    assert quick.recorded_verdicts(quick.locate([str(tree)])) is not None
    assert sorted(p[len(str(tree)) + 1 :] for p in read) == _keyed(tree)
    assert cli("verify", "--site-packages", tree).code == 0
    _rewrite_in_place(tree / VL_MODEL, _one_byte_changed((tree / VL_MODEL).read_bytes()))
    assert cli("verify", "--site-packages", tree, "--json").verdicts()["stream-load"] == "modified"


def test_only_a_file_settled_before_the_reference_stamp_is_keyed(tmp_path):
    """stat_keys keys a file only if its last change lies SETTLED_NS before the reference (a time stamp of the
    same file system taken before the file is read), on the reference's device, and unchanged while read."""
    import os
    import types

    (tmp_path / "vllm").mkdir()
    path = tmp_path / "vllm" / "x.py"
    path.write_text("x = 1\n")
    st = os.stat(path)
    sha = quick.file_sha256()(b"x = 1\n").hexdigest()

    def reference(ctime_ns, dev=st.st_dev):
        return types.SimpleNamespace(st_dev=dev, st_ctime_ns=ctime_ns)

    keyed = quick.stat_keys(
        str(tmp_path), ["vllm/x.py", "vllm/absent.py"], reference(st.st_ctime_ns + quick.SETTLED_NS)
    )
    assert keyed == {"vllm/x.py": [*quick.stat_key(st), sha]}
    assert quick.stat_keys(str(tmp_path), ["vllm/x.py"], reference(st.st_ctime_ns + quick.SETTLED_NS - 1)) == {}
    assert quick.stat_keys(str(tmp_path), ["vllm/x.py"], reference(st.st_ctime_ns)) == {}
    assert quick.stat_keys(str(tmp_path), ["vllm/x.py"], reference(st.st_ctime_ns + 10**12, st.st_dev + 1)) == {}


def test_revert_removes_the_stat_keys_with_the_state(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    assert (tree / ".patch-dsv4" / quick.STAT_KEYS).is_file()
    assert cli("revert", "--site-packages", tree).code == 0
    assert not (tree / ".patch-dsv4").exists()
