"""What people and machines read: 80 columns, quiet and verbose, the next command with the same
target, a dry run that is a real patch, progress lines, short errors, and the JSON contract."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import venv
import zipfile
from pathlib import Path

import pytest

from patch_dsv4.cli import COMMANDS
from patch_dsv4.output.render import short_path
from patch_dsv4.patches.stream_load import VL_MODEL
from patch_dsv4.patches.wide_swa import FLASHINFER_SPARSE
from tests.conftest import ROOT, run_cli
from tests.errors import error_lines, fits
from tests.releases import content_snapshot, copy_tree, hand_edit, pristine_tree, stat_snapshot, wheel
from tests.terminal import in_a_terminal as _in_a_terminal

ANSI = re.compile(r"\x1b\[[0-9;]*m")
SCHEMA = json.loads((ROOT / "patcher" / "report.schema.json").read_text())


# -- lines for people -----------------------------------------------------------------------
# Each patch's row on a pristine release (the header names the tree, and may wrap where its path is long).
ROWS = {
    "0.28.0": [
        "  aux-streams       opt-in          apply --with aux-streams to use it",
        "  dense-exl3        opt-in          apply --with dense-exl3 to use it",
        "  dtype-policy      pending         needed: 2 files to patch",
        "  exl3-wo-a-slices  opt-in          apply --with exl3-wo-a-slices to use it",
        "  loader-skips      pending         needed: 2 files to patch",
        "  stream-load       not-applicable  no vision class in this release",
        "  wide-swa          not-applicable  prefill window rows stay window_size...",
    ],
    "0.30.0": [
        "  aux-streams       opt-in    apply --with aux-streams to use it",
        "  dense-exl3        opt-in    apply --with dense-exl3 to use it",
        "  dtype-policy      upstream  fixed in nvidia/ops/o_proj.py",
        "  exl3-wo-a-slices  opt-in    apply --with exl3-wo-a-slices to use it",
        "  loader-skips      upstream  fixed in common/vl_model.py +3 more",
        "  stream-load       pending   needed: 3 files to patch",
        "  wide-swa          pending   needed: 2 files to patch",
    ],
}


@pytest.mark.parametrize("version", ["0.28.0", "0.30.0"])
def test_status_fits_one_screen_a_line_a_patch(version, make_tree, cli):
    tree = make_tree(version)
    result = cli("status", "--site-packages", tree)
    lines = result.stdout.splitlines()
    assert all(fits(line) for line in lines), [line for line in lines if len(line) > 80]
    assert "\x1b" not in result.stdout and not any(ch in result.stdout for ch in "┏━│┃╇")
    assert "known build; state: none" in lines
    assert lines[lines.index("known build; state: none") + 1 :] == [*ROWS[version], lines[-1]]
    assert lines[-1].startswith("status: ")
    assert len(lines) <= 12, result.stdout  # V4.1 present (0.30.0 printed 34 lines before rows were one line)
    # the files and the evidence are all under -v
    verbose = cli("status", "--site-packages", tree, "-v").stdout
    for patch in cli("status", "--site-packages", tree, "--json").json()["patches"]:
        for file in patch["files"]:  # the short form, whole on one line
            assert any(short_path(file) in line for line in verbose.splitlines()), file
    assert "flashinfer_sparse.py" not in result.stdout  # a file of dtype-policy and wide-swa: -v names it


def test_a_drifted_patch_says_where_at_once_and_the_code_under_v(make_tree, cli):
    tree = make_tree("0.30.0")
    text = (tree / VL_MODEL).read_text()
    anchor = "mapped = iter(sorted(mapped, key=lambda x: x[0]))"
    hand_edit(tree / VL_MODEL, text.replace(anchor, "mapped = iter(sorted(mapped, key=lambda x: (x[0], 0)))"))
    lines = cli("status", "--site-packages", tree).stdout.splitlines()
    row = lines.index("  stream-load       drifted   needed, but the code no longer matches its anchor")
    assert lines[row + 1] == "      common/vl_model.py: anchor not found (load_weights)"
    assert lines[row + 2].startswith("  wide-swa ")  # V4.1's files are untouched: one line, for the one file
    assert anchor not in "\n".join(lines)  # the expected/found block is under -v
    verbose = cli("status", "--site-packages", tree, "-v").stdout.splitlines()
    at = verbose.index("      in common/vl_model.py:DeepseekV4ForConditionalGeneration.load_weights")
    assert verbose[at + 1 : at + 5] == [
        "      expected:",
        f"        {anchor}",
        "      found:",
        "        mapped = iter(sorted(mapped, key=lambda x: (x[0], 0)))",
    ]


def _readme_example(first: str) -> list[str]:
    """The lines of the README's example (an indented block) that starts with the line ``first``."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = lines.index(first)
    block = []
    for line in lines[start + 1 :]:
        if not line.startswith(" " * 4):
            break
        block.append(line[4:])
    return block


def test_the_readme_shows_what_status_prints(make_tree, cli):
    """The README's example is status on a pristine 0.30.0 at 80 columns, byte for byte (rendered for the image's
    site directory it names), and its drifted rows are those a hand-edited vision class gives."""
    from patch_dsv4.output.render import Style, text_lines

    example = _readme_example("    $ patch-dsv4 status")
    tree = make_tree("0.30.0")
    document = cli("status", "--site-packages", tree, "--json").json()
    document["target"] = "/usr/local/lib/python3.12/dist-packages"
    assert text_lines(document, Style(80)) == example
    text = (tree / VL_MODEL).read_text()
    anchor = "mapped = iter(sorted(mapped, key=lambda x: x[0]))"
    hand_edit(tree / VL_MODEL, text.replace(anchor, "mapped = iter(sorted(mapped, key=lambda x: (x[0], 0)))"))
    drifted = cli("status", "--site-packages", tree).stdout.splitlines()
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    at = readme.index("      stream-load       drifted   needed, but the code no longer matches its anchor")
    shown = [line[4:] for line in readme[at : at + 2]]
    assert drifted[drifted.index(shown[0]) : drifted.index(shown[0]) + 2] == shown


def test_quiet_prints_the_closing_line_and_verbose_all_evidence(make_tree, cli):
    tree = make_tree("0.30.0")
    quiet = cli("status", "--site-packages", tree, "-q")
    assert quiet.stdout.splitlines() == ["status: 3 opt-in, 2 upstream, 2 pending"]
    normal = cli("status", "--site-packages", tree).stdout
    verbose = cli("status", "--site-packages", tree, "-v").stdout
    assert "anchor matches" not in normal and "anchor matches" in verbose  # pending evidence only with -v
    assert "deep_gemm_fp8_o_proj" not in normal and "deep_gemm_fp8_o_proj" in verbose  # upstream's, in full
    assert all(fits(line) for line in verbose.splitlines() if not line.startswith("        "))


def test_apply_names_the_files_written_and_where_the_backups_are(make_tree, cli):
    tree = make_tree("0.30.0")
    out = cli("apply", "--site-packages", tree).stdout
    assert f"backups: {tree / '.patch-dsv4' / 'backups'}" in " ".join(out.split())  # may wrap before the path
    assert "  stream-load       applied   our edit, intact, in 3 files\n" in out
    assert out.splitlines()[-1] == "apply: 3 opt-in, 2 upstream, 2 applied; patched 5 file(s)"
    assert VL_MODEL not in out  # the files written are listed with -v
    assert cli("verify", "--site-packages", tree, "-q").stdout.splitlines() == [
        "verify: 3 opt-in, 2 upstream, 2 applied; hashes match the recorded state"
    ]
    listed = cli("revert", "--site-packages", tree, "-v").stdout
    assert f"  {VL_MODEL}\n" in listed and f"  {FLASHINFER_SPARSE}\n" in listed


def test_on_a_terminal_colour_unless_no_color(make_tree):
    tree = make_tree("0.30.0")
    coloured = _in_a_terminal(["status", "--site-packages", str(tree)], columns=80)
    assert "\x1b[" in coloured
    assert all(fits(ANSI.sub("", line)) for line in coloured.splitlines())
    plain = _in_a_terminal(["status", "--site-packages", str(tree)], {"NO_COLOR": "1"}, columns=100)
    assert "\x1b[" not in plain and "pending" in plain


def test_errors_on_a_terminal_are_what_why_next_lines(make_tree):
    tree = make_tree("0.30.0")
    hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + "\n# a local hotfix\n")
    out = _in_a_terminal(["apply", "--site-packages", str(tree)], {"NO_COLOR": "1"})
    lines = out.strip().splitlines()
    # a comment added elsewhere changes no verdict, but the file is not pip's: apply refuses to write it
    assert lines[0].startswith(f"patch-dsv4: error: refusing to patch {VL_MODEL}")
    # the layout of every error, on a terminal as on a pipe: labelled lines within 80 columns
    assert lines[1].startswith("patch-dsv4: why: ")
    assert any(line.startswith("patch-dsv4: next: ") for line in lines[2:])
    assert all(fits(line) for line in lines)


# -- the next command, naming the target as the user did --------------------------------------
@pytest.fixture
def three_targets(make_tree, tmp_path):
    """The same release reached three ways: --site-packages, --python, and the running interpreter."""
    site_tree = make_tree("0.30.0")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    copy_tree(pristine_tree("0.30.0"), Path(purelib))
    default_tree = make_tree("0.30.0")
    return {
        "site-packages": (["--site-packages", str(site_tree)], f" --site-packages {site_tree}", site_tree, None),
        "python": (["--python", str(python)], f" --python {python}", Path(purelib), None),
        "default": ([], "", default_tree, {"PYTHONPATH": f"{default_tree}{os.pathsep}{ROOT}"}),
    }


def _run(args, env_extra):
    if env_extra is None:
        return run_cli(*args)
    proc = subprocess.run(
        [sys.executable, "-m", "patch_dsv4", *args], capture_output=True, text=True, env={**os.environ, **env_extra}
    )
    return proc


@pytest.mark.parametrize("kind", ["site-packages", "python", "default"])
def test_failures_name_the_next_command_for_the_same_target(kind, three_targets):
    args, target_args, tree, env_extra = three_targets[kind]
    verify = _run(["verify", *args], env_extra)
    code = getattr(verify, "code", getattr(verify, "returncode", None))
    assert code == 1
    assert error_lines(verify.stderr)[-1].endswith(f"(next: patch-dsv4 apply{target_args})"), verify.stderr

    hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + "\n# a local hotfix\n")
    refused = _run(["apply", *args], env_extra)
    assert getattr(refused, "code", getattr(refused, "returncode", None)) == 1
    (said,) = error_lines(refused.stderr)
    if kind == "site-packages":
        assert f"pip install --no-deps --force-reinstall --upgrade --target {tree} vllm==0.30.0" in said
    elif kind == "python":
        assert f"{args[1]} -m pip install --no-deps --force-reinstall vllm==0.30.0" in said
    else:
        assert f"{sys.executable} -m pip install --no-deps --force-reinstall vllm==0.30.0" in said
    assert "apply --force" in said


def test_a_hand_edit_elsewhere_is_said_once_and_changes_no_other_verdict(make_tree, monkeypatch):
    """A hand edit to a patched vl_model.py: stream-load is modified; loader-skips, which reads that file for
    evidence, stays upstream; the file's RECORD difference is said once, as a note."""
    tree = make_tree("0.30.0")
    assert run_cli("apply", "--site-packages", tree).code == 0
    hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + "\n# a local hotfix\n")
    monkeypatch.setenv("COLUMNS", "80")
    verify = run_cli("verify", "--site-packages", tree, "--json")
    assert verify.code == 1
    assert verify.verdicts()["stream-load"] == "modified"
    assert verify.verdicts()["loader-skips"] == "upstream" and verify.verdicts()["dtype-policy"] == "upstream"
    text = run_cli("verify", "--site-packages", tree)
    joined = " ".join(text.stdout.split())  # wrapped at 80 columns: join the lines again
    assert joined.count("differs from pip's RECORD") <= 1, text.stdout
    assert all(fits(line) for line in text.stdout.splitlines()), text.stdout


def test_a_hand_edited_patched_file_has_a_way_out_that_loses_nothing(make_tree, cli):
    tree = make_tree("0.30.0")
    original = (tree / VL_MODEL).read_bytes()
    assert cli("apply", "--site-packages", tree).code == 0
    edited = (tree / VL_MODEL).read_text() + "\n# my fix, keep it somewhere\n"
    hand_edit(tree / VL_MODEL, edited)
    verify = cli("verify", "--site-packages", tree)
    assert verify.code == 1 and f"revert --discard-local-edits --site-packages {tree}" in error_lines(verify.stderr)[-1]
    refused = cli("revert", "--site-packages", tree)
    assert refused.code == 1 and "--discard-local-edits" in refused.stderr
    out = cli("revert", "--site-packages", tree, "--discard-local-edits", "--json")
    assert out.code == 0, out.stderr
    (saved,) = out.json()["saved_edits"]
    assert Path(saved).read_text() == edited
    assert Path(saved).is_relative_to(tree / ".patch-dsv4" / "saved-edits")
    assert (tree / VL_MODEL).read_bytes() == original
    assert cli("status", "--site-packages", tree, "--json").json()["state"] == "none"
    assert cli("apply", "--site-packages", tree).code == 0  # the saved edit does not get in the way
    assert Path(saved).read_text() == edited
    assert cli("revert", "--site-packages", tree).code == 0 and Path(saved).exists()


# -- a dry run is apply without the writes ---------------------------------------------------
@pytest.mark.parametrize("version", ["0.28.0", "0.30.0"])
def test_dry_run_diff_is_a_patch_that_gives_what_apply_writes(version, make_tree):
    dry, real = make_tree(version), make_tree(version)
    before = content_snapshot(dry)
    result = run_cli("apply", "--site-packages", dry, "--dry-run")
    assert result.code == 0
    assert content_snapshot(dry) == before and not (dry / ".patch-dsv4").exists()
    assert result.stdout.startswith("--- a/vllm/"), result.stdout[:200]
    assert "dry run" in result.stderr  # the report goes to stderr
    assert run_cli("apply", "--site-packages", real).code == 0
    patched = subprocess.run(["patch", "-p1", "-s", "-d", str(dry)], input=result.stdout.encode(), capture_output=True)
    assert patched.returncode == 0, patched.stderr
    assert content_snapshot(dry) == content_snapshot(real)
    for relpath, _sha in content_snapshot(real).items():
        assert (dry / relpath).read_bytes() == (real / relpath).read_bytes(), relpath


def test_dry_run_refuses_where_apply_refuses(make_tree):
    tree = make_tree("0.30.0")
    hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + "\n# a local hotfix\n")
    dry = run_cli("apply", "--site-packages", tree, "--dry-run")
    real = run_cli("apply", "--site-packages", tree)
    assert dry.code == real.code == 1
    assert dry.stdout == "" and "RECORD" in dry.stderr
    forced = run_cli("apply", "--site-packages", tree, "--dry-run", "--force")
    assert forced.code == 0 and forced.stdout.startswith("--- a/vllm/")


def test_a_refused_apply_json_carries_the_verdicts_it_refused_on(make_tree):
    tree = make_tree("0.30.0")
    hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + "\n# a local hotfix\n")
    status = run_cli("status", "--site-packages", tree, "--json").json()
    for args in (("apply",), ("apply", "--dry-run")):
        refused = run_cli(*args, "--site-packages", tree, "--json")
        document = refused.json()
        _validate(document)
        assert refused.code == document["exit_code"] == 1
        assert "RECORD" in document["error"] and document["summary"] == document["error"]
        assert document["patches"] == status["patches"] and any(p["verdict"] == "pending" for p in document["patches"])
        assert document["target"] == status["target"] and document["vllm_version"] == "0.30.0"
        assert document["next"] and "--force" in document["next"]
        assert set(document) == set(status)


# -- help and usage --------------------------------------------------------------------------
def test_the_top_level_help_shows_every_command_whole_at_80_columns(monkeypatch):
    import typer

    from patch_dsv4.app import app

    monkeypatch.setenv("COLUMNS", "80")
    shown = run_cli("--help")
    assert shown.code == 0 and all(fits(line) for line in shown.stdout.splitlines()), shown.stdout
    listed = shown.stdout.split("Commands:\n")[1].splitlines()
    assert sorted(line.split()[0] for line in listed) == sorted(COMMANDS)
    for line in listed:
        name = line.split()[0]
        command = typer.main.get_command(app).commands[name]
        first = (command.help or "").split("\n\n")[0].strip()
        assert line.split(None, 1)[1] == first and "..." not in line, line


@pytest.mark.parametrize("command", [(), *[(c,) for c in COMMANDS], ("anchors", "record")])
def test_dash_h_is_help_everywhere(command):
    short, long = run_cli(*command, "-h"), run_cli(*command, "--help")
    assert short.code == long.code == 0 and short.stdout == long.stdout and short.stdout.startswith("Usage: ")


def test_a_stray_positional_names_the_option_it_meant(tmp_path):
    result = run_cli("status", tmp_path)
    assert result.code == 2 and result.stdout == ""
    (said,) = error_lines(result.stderr)
    assert f"status takes no positional argument ({tmp_path})" in said
    assert f"next: patch-dsv4 status --site-packages {tmp_path}" in said
    wheel_file = run_cli("drift", tmp_path / "vllm-0.30.0-py3-none-any.whl", "--json")
    assert wheel_file.code == 2 and "drift --wheel " in error_lines(wheel_file.stderr)[0] and wheel_file.json()["error"]
    assert "no patch extra: the patches are " in error_lines(run_cli("list", "extra").stderr)[0]  # patch ids


# -- progress ------------------------------------------------------------------------------
def test_a_lock_wait_says_who_holds_the_lock(make_tree):
    import fcntl

    tree = make_tree("0.30.0")
    lock = tree / ".patch-dsv4.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"pid 4242 since 2026-11-30 08:00:00\n")
    threading.Timer(2.5, lambda: (fcntl.flock(fd, fcntl.LOCK_UN), os.close(fd), lock.unlink())).start()
    started = time.monotonic()
    result = run_cli("apply", "--site-packages", tree, "-q")
    assert result.code == 0, result.stderr
    assert time.monotonic() - started >= 2.0
    said = result.stderr.replace("\npatch-dsv4:   ", " ")  # a line folded to 80 columns
    assert "waiting for the environment's lock, held by pid 4242 since 2026-11-30 08:00:00" in said
    assert all(fits(line) for line in result.stderr.splitlines())


def test_a_lock_never_freed_times_out_naming_the_holder(make_tree):
    import fcntl

    tree = make_tree("0.30.0")
    fd = os.open(tree / ".patch-dsv4.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"pid 4242 since 2026-11-30 08:00:00\n")
    try:
        result = run_cli("apply", "--site-packages", tree, "--lock-timeout", "1.5")
    finally:
        os.close(fd)
    assert result.code == 2
    assert "held by pid 4242" in error_lines(result.stderr)[0]


# -- the JSON contract ---------------------------------------------------------------------
def _validate(document: dict) -> None:
    import jsonschema

    jsonschema.validate(document, SCHEMA)


def test_every_command_writes_a_document_of_the_schema(make_tree, tmp_path):
    tree = make_tree("0.30.0")
    documents = [run_cli("list", "--json").json()]
    for args in (
        ("status",),
        ("verify",),
        ("apply", "--dry-run"),
        ("apply",),
        ("apply",),
        ("verify",),
        ("status",),
        ("revert",),
        ("revert",),
    ):
        result = run_cli(*args, "--site-packages", tree, "--json")
        documents.append(result.json())
    documents.append(run_cli("drift", "--wheel", wheel("vllm", "0.30.0"), "--json").json())
    errors = [
        run_cli("status", "--site-packages", tmp_path / "absent", "--json"),
        run_cli("drift", "--wheel", tmp_path / "absent.whl", "--json"),
        run_cli("apply", "--site-packages", tree, "--only", "no-such-patch", "--json"),
        run_cli("status", "--no-such-option", "--json"),
    ]
    for result in errors:
        assert result.code == 2
        documents.append(result.json())
    for document in documents:
        _validate(document)
    keys = {d["command"]: set(d) for d in documents if d["error"] is None}
    for document in documents:  # the same keys on every path, errors included
        assert set(document) == keys.get(document["command"], set(document)), document["command"]
    fast, slow = documents[6], documents[2]
    assert "hashes match" in fast["summary"] and set(fast) == set(slow)


def test_the_verify_fast_path_gives_the_document_the_full_judgement_gives(make_tree, monkeypatch):
    from patch_dsv4.fastpath import quick

    tree = make_tree("0.30.0")
    assert run_cli("apply", "--site-packages", tree).code == 0
    fast = run_cli("verify", "--site-packages", tree, "--json").json()
    monkeypatch.setattr(quick, "recorded_verdicts", lambda *args, **kwargs: None)
    full = run_cli("verify", "--site-packages", tree, "--json").json()
    assert "hashes match" in fast["summary"] and "hashes match" not in full["summary"]
    for key in (
        "schema",
        "command",
        "exit_code",
        "error",
        "target",
        "vllm_version",
        "flashinfer_version",
        "flashinfer_source",
        "build",
        "state",
        "patches",
        "changed_files",
        "backups",
        "next",
    ):
        assert fast[key] == full[key], key


# -- drift of a nightly ----------------------------------------------------------------------
def test_a_nightly_is_judged_as_an_unknown_build_never_an_error(tmp_path):
    """A wheel built from a real one with a nightly's version (0.33.1.devN+g<sha>)."""
    nightly = "0.33.1.dev127+g5f2a9c0e1"
    real = wheel("vllm", "0.33.0")
    path = tmp_path / real.name.replace("0.33.0", nightly)
    with zipfile.ZipFile(real) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
        for name in src.namelist():
            data = src.read(name)
            new_name = name.replace("vllm-0.33.0.dist-info", f"vllm-{nightly}.dist-info")
            if new_name.endswith(".dist-info/METADATA"):
                data = data.replace(b"\nVersion: 0.33.0\n", f"\nVersion: {nightly}\n".encode(), 1)
            # its Python sources (every module a probe may follow) and dist-info, without RECORD: a small wheel
            if new_name.endswith(".dist-info/RECORD") or not (".dist-info/" in name or name.endswith(".py")):
                continue
            out.writestr(new_name, data)
    result = run_cli("drift", "--wheel", path, "--json")
    assert result.code == 0, result.stderr
    data = result.json()
    _validate(data)
    assert data["vllm_version"] == nightly
    assert data["build"]["known"] is False and "no anchors recorded" in data["build"]["detail"]
    assert {p["id"]: p["verdict"] for p in data["patches"]}["stream-load"] == "upstream"
    table = run_cli("drift", "--wheel", path)
    assert table.code == 0 and "unknown build" in table.stdout


# -- a dry run's diff, list, a markdown report ----------------------------------------------
def test_dry_run_prints_diff_and_writes_nothing(make_tree, cli):
    tree = make_tree("0.31.0")
    before = stat_snapshot(tree)
    result = cli("apply", "--site-packages", tree, "--dry-run")
    assert result.code == 0
    assert f"+++ b/{VL_MODEL}" in result.stdout
    assert "+            mapped = _patch_dsv4_stream_language_model_first(mapped)" in result.stdout
    assert stat_snapshot(tree) == before
    assert not (tree / ".patch-dsv4").exists() and not (tree / ".patch-dsv4.lock").exists()


def test_list_shows_every_patch_with_why(cli):
    result = cli("list", "--json")
    assert result.code == 0
    patches = json.loads(result.stdout)["patches"]
    assert "stream-load" in {p["id"] for p in patches}
    assert all(p["why"] and p["title"] for p in patches)


def test_markdown_report(make_tree, cli):
    tree = make_tree("0.33.0")
    result = cli("status", "--site-packages", tree, "--format", "markdown")
    assert result.code == 0
    assert "| `stream-load` | upstream |" in result.stdout


# -- short output ------------------------------------------------------------------------------------------------
def test_an_error_line_in_a_pipe_is_at_most_200_characters(make_tree):
    tree = make_tree("0.30.0")
    hand_edit(tree / VL_MODEL, (tree / VL_MODEL).read_text() + "\n# a local hotfix\n")
    out = subprocess.run(
        [sys.executable, "-m", "patch_dsv4", "apply", "--site-packages", str(tree), "--only", "x" * 5000],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and out.stderr.strip()
    assert all(len(line) <= 200 for line in out.stderr.splitlines()), out.stderr
    refused = subprocess.run(
        [sys.executable, "-m", "patch_dsv4", "apply", "--site-packages", str(tree)], capture_output=True, text=True
    )
    assert refused.returncode == 1
    assert all(len(line) <= 200 for line in refused.stderr.splitlines()) and "next:" in refused.stderr


@pytest.mark.parametrize("command", ["status", "apply", "takeover", "verify", "revert", "drift", "doctor"])
def test_help_shows_no_python_type_names(command):
    out = subprocess.run([sys.executable, "-m", "patch_dsv4", command, "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for name in ("<str>", "<path>", "<float>", "list[", "<int>", "TEXT", "FLOAT"):
        assert name not in out.stdout, (name, out.stdout)
