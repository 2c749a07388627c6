"""What a newcomer meets first (issue 40): --with, list, interrupts, hand edits outside a patch, write failures,
one error layout, drift's and status's lines, and every human line within 80 columns."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from patch_dsv4.patches.stream_load import VL_MODEL
from patch_dsv4.patches.wide_swa import FLASHINFER_SPARSE
from tests.conftest import ROOT, run_cli
from tests.errors import error_lines, fits
from tests.releases import content_snapshot, hand_edit
from tests.terminal import in_a_terminal

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
    assert len(lines) == len(patches) + 1 and all(fits(line) for line in lines), lines
    for patch, line in zip(patches, lines, strict=False):
        assert re.match(rf"{re.escape(patch.id)} +{'opt-in' if patch.opt_in else 'default'} +\S", line), line
    assert lines[-1] == "list: 7 patches, 3 opt-in; what each fixes and why: patch-dsv4 list ID (or -v)"
    one = cli("list", "wide-swa")
    prose = one.stdout.splitlines()
    assert one.code == 0 and prose[0].startswith("wide-swa: SM120 prefill")
    assert all(fits(line) for line in prose) and "Fixed upstream in FlashInfer 0.7.0" in one.stdout
    assert "aux-streams" not in one.stdout
    verbose = cli("list", "-v").stdout
    assert all(fits(line) for line in verbose.splitlines())
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
        assert lines and all(fits(line) for line in lines), result.stderr
        assert all(re.match(r"patch-dsv4: (error|why|next|  )", line) for line in lines), result.stderr
        assert any(line.startswith("patch-dsv4: next: patch-dsv4 ") for line in lines), result.stderr
    assert "run:" not in failed.stderr
    assert error_lines(failed.stderr) == [
        "patch-dsv4: error: stream-load is pending in common/vl_model.py and 2 more files",
        "patch-dsv4: error: wide-swa is pending in nvidia/flashinfer_sparse.py and 1 more file"
        f" (next: patch-dsv4 apply --site-packages {tree})",
    ]


# -- 3. Ctrl-C: one line of what happened and what state the tree is in ---------------------------
def _interrupted_at(step: str, tree, *args):
    from patch_dsv4.tree.fs import inject_faults

    def hook(at: str) -> None:
        if at == step:
            raise KeyboardInterrupt

    with inject_faults(hook):
        return run_cli(*args, "--site-packages", tree)


def test_an_apply_interrupted_before_its_commit_changed_nothing_and_says_so(make_tree, cli):
    tree = make_tree("0.30.0")
    before = content_snapshot(tree)
    for step in ("judged", "prepared", f"replace:{FLASHINFER_SPARSE.rsplit('/', 1)[1]}"):
        result = _interrupted_at(step, tree, "apply")
        assert result.code == 130, (step, result.stderr)
        (said,) = error_lines(result.stderr)
        assert said.startswith("patch-dsv4: error: interrupted: apply changed nothing"), said
        assert said.endswith(f"(next: patch-dsv4 apply --site-packages {tree})")
        assert content_snapshot(tree) == before and not (tree / ".patch-dsv4").exists()


def test_an_apply_interrupted_after_its_commit_says_it_completed(make_tree, cli, monkeypatch):
    from patch_dsv4.pipeline import transaction

    tree = make_tree("0.30.0")

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transaction, "Committed", interrupt)  # the manifest is saved: the apply is whole
    result = cli("apply", "--site-packages", tree)
    monkeypatch.undo()
    assert result.code == 130 and result.stdout == ""
    assert error_lines(result.stderr) == [
        "patch-dsv4: error: interrupted after apply completed: patched 5 file(s): only its report was cut short"
        f" (next: patch-dsv4 status --site-packages {tree})"
    ]
    assert cli("verify", "--site-packages", tree).code == 0


@pytest.mark.parametrize("when", ["before the first copy", "as it removes the emptied staged/"])
def test_an_apply_interrupted_as_it_removes_its_staged_copies_is_said_completed_by_status(
    when, make_tree, cli, monkeypatch
):
    """Ctrl-C after the commit, while apply removes its staged copies (before the first, or once staged/ is empty):
    status says the apply completed (the rows say applied), never that it was interrupted before it changed a
    file; the next apply removes them."""
    from patch_dsv4.tree.state import StateStore

    tree = make_tree("0.30.0")
    if when == "before the first copy":
        clear = StateStore.clear_staged

        def interrupt(self, *args, **kwargs):
            monkeypatch.setattr(StateStore, "clear_staged", clear)
            raise KeyboardInterrupt

        monkeypatch.setattr(StateStore, "clear_staged", interrupt)
        result = cli("apply", "--site-packages", tree)
        monkeypatch.undo()
    else:
        result = _interrupted_at("rmdir:staged", tree, "apply")
        assert list((tree / ".patch-dsv4" / "staged").iterdir()) == []
    assert result.code == 130 and "apply completed" in " ".join(error_lines(result.stderr)), result.stderr
    assert (tree / ".patch-dsv4" / "staged").is_dir()
    status = cli("status", "--site-packages", tree)
    note = " ".join(status.stdout.split("note: ", 1)[1].split())
    assert note.startswith("an apply completed and was interrupted while it removed its staged copies"), note
    assert "interrupted before it changed a file" not in status.stdout
    assert all(fits(line) for line in status.stdout.splitlines())
    assert cli("verify", "--site-packages", tree).code == 0
    assert cli("apply", "--site-packages", tree).code == 0 and not (tree / ".patch-dsv4" / "staged").exists()


def test_a_staged_copy_an_interrupt_left_is_said_by_status_and_removed_by_the_next_apply(make_tree, cli, monkeypatch):
    from patch_dsv4.pipeline import transaction

    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transaction, "_undo_prepare", interrupt)  # a second Ctrl-C while it puts things back
    result = _interrupted_at("prepared", tree, "apply", "--with", "aux-streams")
    monkeypatch.undo()
    assert result.code == 130 and "interrupted: apply changed nothing" in error_lines(result.stderr)[0]
    assert (tree / ".patch-dsv4" / "staged").is_dir()
    status = cli("status", "--site-packages", tree)
    assert "state: current" in status.stdout
    note = " ".join(status.stdout.split("note: ", 1)[1].split("\n")[:3])
    assert note.startswith("an apply was interrupted before it changed a file: .patch-dsv4/staged/ holds what it")
    assert "the next apply or revert removes" in note
    assert all(fits(line) for line in status.stdout.splitlines())
    assert cli("apply", "--site-packages", tree).code == 0
    assert (
        not (tree / ".patch-dsv4" / "staged").exists() and "note:" not in cli("status", "--site-packages", tree).stdout
    )


def test_a_read_only_command_interrupted_says_it_changed_nothing(make_tree, cli, monkeypatch):
    from patch_dsv4.pipeline import commands

    tree = make_tree("0.30.0")

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "judge_state", interrupt)
    result = cli("status", "--site-packages", tree)
    assert result.code == 130 and error_lines(result.stderr) == [
        "patch-dsv4: error: interrupted: status changed nothing"
    ]


# -- 4. a hand edit outside a patch's scope is said as such --------------------------------------
def test_a_comment_appended_to_a_patched_file_is_said_to_be_outside_our_edit(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + "# a note of mine\n")
    verify = cli("verify", "--site-packages", tree)
    assert verify.code == 1  # not the bytes we wrote: not intact, whatever changed
    lines = verify.stdout.splitlines()
    row = lines.index("  stream-load       modified  its file changed, outside our edit")
    assert lines[row + 1] == "      common/vl_model.py: changed outside our edit (load_weights)"
    (failed,) = error_lines(verify.stderr)  # one file named, the one that changed
    assert failed.startswith("patch-dsv4: error: stream-load is modified in common/vl_model.py (next: ")
    assert f"revert --discard-local-edits --site-packages {tree} (your edit is saved first), then apply" in failed
    edits = cli("verify", "--site-packages", tree, "--json").patch("stream-load")["edits"]
    (edit,) = [e for e in edits if e["verdict"] == "modified"]
    assert "changed outside our edit" in edit["detail"] and "load_weights is as patch-dsv4 wrote it" in edit["detail"]


def test_a_change_inside_our_edit_shows_the_lines_that_changed(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    text = (tree / VL_MODEL).read_text()
    call = "mapped = _patch_dsv4_stream_language_model_first(mapped)"
    hand_edit(tree / VL_MODEL, text.replace(call, call + "  # mine", 1))
    status = cli("status", "--site-packages", tree).stdout.splitlines()
    row = status.index("  stream-load       modified  changed since patch-dsv4 wrote it")
    assert status[row + 1] == "      common/vl_model.py: changed since patch-dsv4 wrote it (load_weights)"
    verbose = cli("status", "-v", "--site-packages", tree).stdout
    expected, found = verbose.split("expected:\n", 1)[1].split("      found:\n", 1)
    assert call in expected and call + "  # mine" not in expected
    assert call + "  # mine" in found.split("\n  wide-swa")[0]
    assert len(expected.splitlines()) <= 6  # the lines around the change, not the whole function


# -- 5. write failures name the cause and a next step that works -----------------------------------
def _root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (chattr, chmod over another user's files)")


def test_an_immutable_file_is_named_with_the_command_that_frees_it(make_tree, cli):
    _root_only()
    tree = make_tree("0.30.0")
    target = tree / FLASHINFER_SPARSE
    if subprocess.run(["chattr", "+i", str(target)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here")
    try:
        result = cli("apply", "--site-packages", tree)
        assert result.code == 2
        assert all(fits(line) or len(line.split()) <= 3 for line in result.stderr.splitlines())
        (said,) = error_lines(result.stderr)
        assert said == (
            f"patch-dsv4: error: cannot write {FLASHINFER_SPARSE}: Operation not permitted: the file is immutable"
            f" (chattr +i; lsattr shows it); nothing was changed (next: chattr -i {target} && patch-dsv4 apply"
            f" --site-packages {tree})"
        )
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)
    assert cli("apply", "--site-packages", tree).code == 0  # the next step, as given, works


def _as_nobody(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is not installed: cannot run as another user")
    return subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-m", "patch_dsv4", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "80"},
    )


def test_a_tree_a_user_may_not_write_is_said_by_apply_and_verify_alike():
    _root_only()
    from tests.releases import minimal_tree

    base = Path(tempfile.mkdtemp(prefix="patch-dsv4-ro-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        tree = minimal_tree("0.30.0", base / "site-packages")  # root's, readable by all
        apply = _as_nobody("apply", "--site-packages", str(tree))
        assert apply.returncode == 2 and "Traceback" not in apply.stderr, apply.stderr
        assert error_lines(apply.stderr) == [
            f"patch-dsv4: error: cannot apply: nobody may not write {tree}: its lock, its state and vLLM's files"
            f" there belong to root (next: patch-dsv4 apply --site-packages {tree}, as root)"
        ]
        verify = _as_nobody("verify", "--site-packages", str(tree))
        assert verify.returncode == 1, verify.stderr
        assert error_lines(verify.stderr)[-1].endswith(
            f"(next: patch-dsv4 apply --site-packages {tree}, as root (nobody may not write {tree}))"
        )
        assert all(fits(line) for line in apply.stderr.splitlines() + verify.stderr.splitlines())
    finally:
        shutil.rmtree(base)


def test_read_only_files_written_as_root_keep_their_mode_and_are_noted(make_tree, cli):
    _root_only()
    tree = make_tree("0.30.0")
    models = tree / "vllm" / "models"
    subprocess.run(["chmod", "-R", "a-w", str(models)], check=True)
    try:
        result = cli("apply", "--site-packages", tree)
        assert result.code == 0, result.stderr
        assert (tree / VL_MODEL).stat().st_mode & 0o777 == 0o444
        note = " ".join(result.stdout.split("note: ", 1)[1].split("\n")[:3])
        assert note.startswith("patched 5 file(s) whose mode lets no one write them (mode -r--r--r--, e.g.")
        assert "root may write them, and each keeps its mode" in note
        reverted = cli("revert", "--site-packages", tree)
        assert "restored 5 file(s) whose mode lets no one write them" in " ".join(reverted.stdout.split())
        assert (tree / VL_MODEL).stat().st_mode & 0o777 == 0o444
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(models)], check=True)


# -- every human line of every command within 80 columns ---------------------------------------------
def _wide(result) -> list[str]:
    """Lines over 80 columns in what a command printed for people (a word longer than a line stands whole)."""
    lines = result.stdout.splitlines() + result.stderr.splitlines()
    return [line for line in lines if len(line) > 80 and len(line.split()) > 3]


@pytest.mark.parametrize("version", ["0.30.0", "0.34.0"])
def test_every_command_fits_80_columns_on_a_real_tree(version, make_tree, cli, tmp_path, monkeypatch):
    from tests.doctor.synthetic import build_mixedk_pack
    from tests.releases import wheel

    monkeypatch.setenv("COLUMNS", "80")
    tree = make_tree(version)
    site = ("--site-packages", tree)
    whl = wheel("vllm", version)
    pack = build_mixedk_pack(tmp_path / "pack")
    serve = ("--serve-args", "--tensor-parallel-size 1 --max-model-len 65536 --quantization exl3")
    runs = [
        ("list",),
        ("list", "-v"),
        ("list", "wide-swa"),
        ("status", *site),
        ("status", "-v", *site),
        ("verify", *site),
        ("verify", "-v", *site),
        ("apply", "--dry-run", *site),
        ("takeover", "--dry-run", *site),
        ("apply", "--with", "stream-load", *site),
        ("apply", "-v", "--with", "aux-streams", *site),
        ("status", "-v", *site),
        ("verify", *site),
        ("apply", *site),
        ("drift", "--wheel", whl),
        ("drift", "-v", "--wheel", whl),
        ("doctor", *site, "--pack", pack, *serve),
        ("doctor", "-v", *site, "--pack", pack, *serve),
        ("anchors", "record", "--check", "--vllm-version", version, "--cache-dir", whl.parent),
        ("status", tree),
        ("revert", "-v", *site),
        ("revert", *site),
    ]
    for args in runs:
        result = cli(*args)
        assert "Traceback" not in result.stderr, (args, result.stderr)
        if "--dry-run" in args:  # stdout is the diff, for patch -p1: the report is on stderr
            result.stdout = ""
        assert not _wide(result), (args, _wide(result))
    hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + "# mine\n")
    for args in (("status", *site), ("verify", *site), ("apply", *site), ("revert", *site)):
        result = cli(*args)
        assert not _wide(result), (args, _wide(result))


# -- 8. drift's and status -v's lines; the README's fingerprint ----------------------------------------
def test_drift_fits_80_columns_and_says_what_absent_means(cli, monkeypatch):
    from tests.releases import wheel

    whl = wheel("vllm", "0.34.0")
    result = cli("drift", "--wheel", whl)
    lines = result.stdout.splitlines()
    assert all(fits(line) for line in lines), [line for line in lines if len(line) > 80]
    assert lines[:3] == ["vLLM 0.34.0 (FlashInfer 0.7.3, pinned)", f"at wheel {whl.name}", "known build"]
    assert lines[-1] == "drift: vLLM 0.34.0, known build: 3 opt-in, 4 upstream"
    document = cli("drift", "--wheel", whl, "--json").json()
    absent = [a for p in document["patches"] for a in p["anchors"] if a["status"] == "absent"]
    recorded = [a for p in document["patches"] for a in p["anchors"] if a["status"] == "recorded"]
    said = " ".join(result.stdout.split())
    assert (
        f"note: functions around the anchors: {len(recorded)} recorded as anchors/ records them, {len(absent)} absent"
        " from this release (another layout's or release's code: -v names each)"
    ) in said
    verbose = cli("drift", "-v", "--wheel", whl).stdout.splitlines()
    assert all(fits(line) for line in verbose)
    assert "      deepseek_v4_1/nvidia/model.py: absent from this release" in verbose


def test_status_v_shows_the_fingerprint_within_80_columns_and_the_readme_its_format(make_tree, cli):
    tree = make_tree("0.30.0")
    whole = cli("status", "--fingerprint", "--site-packages", tree).stdout.strip()
    lines = cli("status", "-v", "--site-packages", tree).stdout.splitlines()
    at = lines.index("fingerprint of what this tree serves (status --fingerprint prints it whole):")
    shown = lines[at + 1]
    assert len(shown) <= 80 and shown.endswith(":...") and whole.startswith(shown[2:-3])
    assert shown.startswith("  dsv4:1:") and ":vllm-0.30.0:fi-0.6.18.post1-pinned:" in shown
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown_there = set(re.findall(r"dsv4:1:[^`\s]*", readme))
    assert shown_there and all(whole.startswith(text.removesuffix("...")) for text in shown_there), shown_there


# -- 9. words that read as what they are; one way to name a file; the README's first command -------------
def test_a_pending_row_reads_as_a_fact_and_a_file_is_named_one_way(make_tree, cli):
    pending = cli("status", "--site-packages", make_tree("0.30.0")).stdout
    assert "  stream-load       pending   needed: 3 files to patch" in pending.splitlines()
    assert "apply patches" not in pending
    upstream = cli("status", "--site-packages", make_tree("0.34.0")).stdout.splitlines()
    assert "  stream-load       upstream  fixed in common/vl_model.py +2 more" in upstream
    assert "  loader-skips      upstream  fixed in common/vl_model.py +3 more" in upstream


def _readme_sections() -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    name = ""
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            name = line[3:]
        sections.setdefault(name, []).append(line)
    return sections


def test_the_readmes_first_command_reports_the_tools_status_and_writes_no_fixed_path(tmp_path):
    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)
    job = blocks[0].strip()
    assert job.startswith("T=$(mktemp -d) && ") and "/tmp/" not in job
    tail = job[job.index("; rc=$?") :]
    assert tail == '; rc=$?; rm -rf "$T"; (exit $rc)'
    for status in (0, 1, 2):  # what the tool exits with is what the command exits with; the scratch dir goes
        seen = tmp_path / f"seen-{status}"
        run = subprocess.run(["bash", "-c", f'T=$(mktemp -d) && echo "$T" > {seen} && (exit {status}){tail}'])
        assert run.returncode == status and not Path(seen.read_text().strip()).exists()
    how = [line for line in _readme_sections()["How it works"][1:] if line.strip()]
    assert len(how) <= 20, len(how)
    adding = [line for line in _readme_sections()["Adding a patch"][1:] if line.strip()]
    assert len(adding) <= 15, len(adding)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "python examples/try_doctor.py" in readme
    # the README opens with its two commands (the tool's job, then the tests); what else there is to try follows
    opening = readme[: readme.index("\n## ")]
    assert opening.count("```sh\n") == 2 and opening.index("examples/try_doctor.py") > opening.rindex("```sh\n")


# -- 10. progress for long work, on a terminal only ----------------------------------------------------------
def _slow_index(tmp_path: Path, seconds: float):
    """A PEP 503 index on loopback serving one small vllm wheel (9.9.9) slowly, as a real index serves a big one."""
    import threading
    import zipfile
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    wheel_path = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel_path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("vllm-9.9.9.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
        zf.writestr("vllm-9.9.9.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("vllm/blob.bin", os.urandom(4_000_000))
        zf.writestr("vllm-9.9.9.dist-info/RECORD", "")
    data = wheel_path.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path.rstrip("/") == "/simple/vllm":
                body = f'<a href="/files/{wheel_path.name}">{wheel_path.name}</a>'.encode()
            elif self.path == f"/files/{wheel_path.name}":
                body = None
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html" if body is not None else "application/octet-stream")
            self.send_header("Content-Length", str(len(body if body is not None else data)))
            self.end_headers()
            if body is not None:
                self.wfile.write(body)
                return
            step = len(data) // 20
            for start in range(0, len(data), step):
                self.wfile.write(data[start : start + step])
                self.wfile.flush()
                time.sleep(seconds / 20)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"--pip-option=--index-url=http://127.0.0.1:{server.server_address[1]}/simple"


def test_a_wheel_fetch_shows_bytes_and_rate_on_a_terminal_and_nothing_more_on_a_pipe(tmp_path):
    server, index = _slow_index(tmp_path, 3.0)
    try:
        args = [
            sys.executable,
            "-m",
            "patch_dsv4",
            "drift",
            "--vllm-version",
            "9.9.9",
            index,
            "--pip-option=--no-cache-dir",
        ]
        env = {**os.environ, "COLUMNS": "80", "TERM": "xterm"}
        shown = in_a_terminal([*args[3:], "--cache-dir", str(tmp_path / "tty")])
        shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)
        frames = shown.replace("\r\n", "\n").replace("\r", "\n").splitlines()
        bars = [f for f in frames if f.startswith("vllm==9.9.9 ") and "MB/s" in f]
        assert bars, shown[-2000:]
        assert any(re.search(r" [0-9.]+/4\.0 MB [0-9.]+ [kM]B/s", f) for f in bars), bars[-3:]
        assert all(len(f) <= 80 for f in bars)
        counts = [re.search(r" ([0-9.]+)/([0-9.]+) MB ", f) for f in bars]
        assert all(float(m[1]) <= float(m[2]) for m in counts if m), bars  # never past the wheel's size
        piped = subprocess.run([*args, "--cache-dir", str(tmp_path / "pipe")], capture_output=True, text=True, env=env)
        assert "━" not in piped.stderr and "/s" not in piped.stderr
        assert "patch-dsv4: fetching vllm==9.9.9 with pip" in piped.stderr and "patch-dsv4: fetched " in piped.stderr
        quiet = subprocess.run(
            [*args, "-q", "--cache-dir", str(tmp_path / "quiet")], capture_output=True, text=True, env=env
        )
        assert "fetch" not in quiet.stderr and quiet.stdout.strip().startswith("drift: vLLM 9.9.9")
    finally:
        server.shutdown()


def test_the_fetch_counts_the_download_once_where_pips_cache_writes_it_twice(tmp_path):
    """Over https pip's HTTP cache writes each body into its temporary directory beside pip-unpack-*/NAME.whl: the
    bar counts the download, not both copies (it ran to 466.4/239.0 MB on the real index)."""
    from patch_dsv4.releases.release_wheel import _largest_under

    (tmp_path / "pip-unpack-x").mkdir()
    (tmp_path / "pip-unpack-x" / "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"w" * 70_000)
    (tmp_path / "tmpdykfw4y0").write_bytes(b"w" * 69_750)  # the cache's copy, a chunk behind
    assert _largest_under(str(tmp_path)) == 70_000


def test_rich_is_imported_only_where_progress_is_shown(make_tree, cli):
    from tests.releases import wheel

    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    code = (
        "import sys; from patch_dsv4.cli import main\n"
        "for args in sys.argv[1:]:\n"
        "    main(args.split('|'))\n"
        "print(sorted(m for m in sys.modules if m == 'rich' or m.startswith('rich.')))\n"
    )
    runs = [
        f"verify|--site-packages|{tree}",
        f"status|--site-packages|{tree}",
        f"drift|--wheel|{wheel('vllm', '0.30.0')}",
    ]
    out = subprocess.run([sys.executable, "-c", code, *runs], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:] + out.stderr[-500:]


# -- the entry point: doctor tried in a minute ------------------------------------------------------------
def test_try_doctor_builds_its_packs_and_its_commands_work(tmp_path, make_tree, monkeypatch):
    import importlib.util
    import shlex

    spec = importlib.util.spec_from_file_location("try_doctor", ROOT / "examples" / "try_doctor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    packs = module.build(tmp_path / "packs")
    assert sorted(packs) == ["dsv4-small", "dsv41-flash", "dsv41-no-engram"]
    tree = make_tree("0.34.0")
    lines = module.commands(packs, ["--site-packages", str(tree)], None)
    commands = " ".join(line for line in lines if not line.startswith("#")).replace("\\ ", " ").split("patch-dsv4 ")
    results = []
    for command in filter(str.strip, commands):
        result = run_cli(*shlex.split(command))
        assert result.code in (0, 1) and "Traceback" not in result.stderr, (command, result.stderr)
        results.append(result.stdout)
    assert all(r.splitlines()[-1].startswith("doctor: ") for r in results)
    assert "fail  v41.engram-tables" in results[2] and "fail  v41.engram-tables" not in results[1]
    assert all(fits(line) for line in lines if not line.startswith(("    --site-packages", "    --pack /")))
