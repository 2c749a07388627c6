"""verify's fast path: what it imports, and that it says what the typed report says, in every format."""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
import textwrap
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from patch_dsv4.fastpath import quick
from patch_dsv4.output import render
from patch_dsv4.output.verdicts import Report
from patch_dsv4.patches.stream_load import VL_MODEL
from tests.releases import wheel_file

#: The file whose dtype gate dtype-policy judges upstream on 0.30.0: ``==`` for ``!=`` there makes it pending.
O_PROJ = "vllm/models/deepseek_v4/nvidia/ops/o_proj.py"

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


# -- no trust without reading: every file vouched for is read and hashed in this run ------------------------------
def _hashed(monkeypatch) -> list[str]:
    """The files the fast path reads and hashes in this process, from now on (an absent one is not read)."""
    read: list[str] = []
    real = quick.sha256_file

    def sha256_file(path, *args):
        found = real(path, *args)
        read.extend([path] if found is not None else [])
        return found

    monkeypatch.setattr(quick, "sha256_file", sha256_file)
    return read


def _vouched_for(tree) -> list[str]:
    """The files the fast path vouches for on ``tree``'s state that are there: every file the manifest says apply
    wrote and judged from, and every file the release's record lists."""
    manifest = quick.read_manifest(str(tree))
    record = quick.anchors_record(quick.locate([str(tree)]).vllm_version)
    found = set(manifest["files"]) | set(manifest["inputs"]) | set(record["files"])
    return sorted(rel for rel in found if (tree / rel).is_file())


def _one_byte_changed(data: bytes) -> bytes:
    """``data`` with one letter of a comment changed: the same size, other bytes."""
    at = data.index(b"# ") + 2
    return data[:at] + (b"X" if data[at : at + 1] != b"X" else b"Y") + data[at + 1 :]


def _written_through_mmap(path, data: bytes) -> None:
    """Write ``data`` (the same size) into the file through a shared mapping, then set its mtime back: what a
    write through mmap may leave of its trace (on tmpfs, a page read first keeps even ctime where it was)."""
    import mmap
    import os

    before = os.stat(path)
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mapped:
        assert len(mapped) == len(data)
        _ = mapped[: len(data)]  # read first
        mapped[:] = data
        mapped.flush()
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


def test_every_file_vouched_for_is_read_and_hashed_in_this_run(make_tree, cli, monkeypatch):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    assert not (tree / ".patch-dsv4" / "stat-keys.json").exists()  # apply keeps no file attributes for them
    for _ in range(2):  # and a second run reads them again: nothing is kept between runs
        read = _hashed(monkeypatch)
        assert quick.recorded_verdicts(quick.locate([str(tree)])) is not None
        assert sorted(p[len(str(tree)) + 1 :] for p in read) == _vouched_for(tree)
        assert len(read) > 20


@pytest.mark.parametrize("where", ["tmpfs", "this file system"])
def test_bytes_written_through_mmap_are_caught_whatever_the_file_attributes_say(where, make_tree, cli, tmp_path):
    """The dtype gate inverted in place (``==`` for ``!=``, the same size) through a shared mapping, the mtime set
    back: verify, --expect and the guard's fingerprint say so, as a full status does."""
    import shutil

    source = make_tree("0.30.0")
    if where == "tmpfs":
        shm = Path("/dev/shm")
        if not shm.is_dir() or not os.access(shm, os.W_OK):
            pytest.skip("no writable /dev/shm (tmpfs) here")
        tree = Path(shutil.copytree(source, shm / f"patch-dsv4-{os.getpid()}" / "site-packages", symlinks=True))
    else:
        tree = source
    try:
        assert cli("apply", "--site-packages", tree).code == 0
        expected = cli("status", "--fingerprint", "--site-packages", tree).stdout.strip()
        path = tree / O_PROJ
        data = path.read_bytes()
        _written_through_mmap(path, data.replace(b"dtype == torch.float8", b"dtype != torch.float8", 1))
        assert quick.recorded_verdicts(quick.locate([str(tree)])) is None
        verify = cli("verify", "--site-packages", tree, "--expect", expected, "--json")
        assert verify.code == 1 and verify.verdicts()["dtype-policy"] == "pending", verify.stdout
        assert cli("status", "--fingerprint", "--site-packages", tree).stdout.strip() != expected
    finally:
        if where == "tmpfs":
            shutil.rmtree(tree.parent, ignore_errors=True)


def test_a_copied_tree_is_hashed_and_judged_the_same(make_tree, cli, tmp_path):
    """Another inode for every file copied: the verdicts are the same; a one-byte edit in the copy (size and mtime
    kept) is caught."""
    import shutil

    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    copy = shutil.copytree(tree, tmp_path / "copy" / "site-packages", symlinks=True)  # cp -a: times kept
    here, there = (quick.recorded_verdicts(quick.locate([str(t)])) for t in (tree, copy))
    assert here is not None and there is not None and here.verdicts == there.verdicts and here.files == there.files
    assert cli("verify", "--site-packages", copy).code == 0
    _written_through_mmap(copy / VL_MODEL, _one_byte_changed((copy / VL_MODEL).read_bytes()))
    assert quick.recorded_verdicts(quick.locate([str(copy)])) is None
    assert cli("verify", "--site-packages", copy, "--json").verdicts()["stream-load"] == "modified"


@pytest.mark.parametrize("keys", ["forged", "cut", "not-json", "a-fifo"])
def test_an_old_stat_keys_file_is_never_read_and_apply_removes_it(keys, make_tree, cli):
    """Older versions kept stat-keys.json (file attributes standing for sha256s). Forged to vouch for other bytes,
    cut in half, not JSON or a FIFO: none of it is read (the other bytes are caught), and a no-op apply removes it."""
    import json

    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    expected = cli("status", "--fingerprint", "--site-packages", tree).stdout.strip()
    path = tree / O_PROJ
    path.write_bytes(path.read_bytes().replace(b"dtype == torch.float8", b"dtype != torch.float8", 1))
    sidecar = tree / ".patch-dsv4" / "stat-keys.json"
    st = os.stat(path)
    forged = {"format": 1, "files": {O_PROJ: [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, "0"]}}
    if keys == "a-fifo":
        os.mkfifo(sidecar)
    else:
        text = json.dumps(forged)
        sidecar.write_text({"forged": text, "cut": text[: len(text) // 2], "not-json": "{not json"}[keys])
    verify = cli("verify", "--site-packages", tree, "--expect", expected, "--json")
    assert verify.code == 1 and verify.verdicts()["dtype-policy"] == "pending"
    assert any(O_PROJ in note for note in verify.json()["notes"])
    path.write_bytes(path.read_bytes().replace(b"dtype != torch.float8", b"dtype == torch.float8", 1))
    noop = cli("apply", "--site-packages", tree)
    assert noop.code == 0 and "nothing to do" in noop.stdout
    assert not os.path.lexists(sidecar)


def test_revert_leaves_no_state(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    (tree / ".patch-dsv4" / "stat-keys.json").write_text("{}")  # an older version's
    assert cli("revert", "--site-packages", tree).code == 0
    assert not (tree / ".patch-dsv4").exists()


# -- the fast grammar and Typer's ---------------------------------------------------------------------------------
def _typer_options(command: str) -> dict[str, bool]:
    """Every option of Typer's ``command`` (each spelling), and whether it is a flag."""
    import click
    import typer

    from patch_dsv4.app import app

    group = typer.main.get_command(app)
    sub = group.commands[command]
    parent = click.Context(group, **group.context_settings)  # where -h is added to every command
    found = dict.fromkeys(sub.get_help_option_names(click.Context(sub, parent=parent, **sub.context_settings)), True)
    for param in sub.params:
        for name in (*param.opts, *param.secondary_opts):
            if name.startswith("-"):
                found[name] = bool(getattr(param, "is_flag", False))
    return found


@pytest.mark.parametrize("command", ["verify", "doctor"])
def test_the_fast_grammar_is_typers(command):
    """Each option the fast path reads is one of Typer's, a value where Typer takes a value and a flag where Typer
    takes a flag; each of Typer's options is read by the fast path or listed as left to Typer; --format's choices are
    Typer's. An option added to one command line and not the other fails here."""
    from patch_dsv4 import cli
    from patch_dsv4.app import Format

    typer_options = _typer_options(command)
    values, flags, left = cli._VALUES[command], cli._COMMAND_FLAGS[command], cli.LEFT_TO_TYPER[command]
    assert not set(values) & set(flags) and not (set(values) | set(flags)) & set(left)
    assert set(values) | set(flags) | set(left) == set(typer_options)
    assert all(not typer_options[name] for name in values), "a fast value is a flag of Typer's"
    assert all(typer_options[name] for name in flags), "a fast flag takes a value in Typer"
    assert all(name in cli._FLAGS for name in flags)
    assert set(cli.FORMATS) == {f.value for f in Format}


def test_an_option_left_to_typer_is_answered_by_typer(make_tree, cli):
    """--with, --lock-timeout and --python are not read by the fast path: verify takes Typer's path with them and
    answers the same."""
    from patch_dsv4 import cli as entry

    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    assert entry._plain_options(["verify", "--site-packages", str(tree)], "verify") is not None
    for extra in (["--lock-timeout", "5"], ["--with", "aux-streams"]):
        assert entry._plain_options(["verify", "--site-packages", str(tree), *extra], "verify") is None
    assert cli("verify", "--site-packages", tree, "--lock-timeout", "5").code == 0


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
