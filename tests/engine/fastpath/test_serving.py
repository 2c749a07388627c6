"""The fingerprint of what a tree serves (patch_dsv4.fastpath.serving), on real release trees: equal trees give equal
fingerprints wherever they are; one opt-in, one byte, another FlashInfer, build or release give another, and
``verify --expect``, the guard and PATCH_DSV4_WITH act on it."""

from __future__ import annotations

import json
import logging

import pytest

from patch_dsv4 import guard
from patch_dsv4.fastpath import quick, serving
from tests.engine.fastpath.test_fast_verify import _fresh_verify
from tests.errors import error_lines, fits
from tests.releases import hand_edit, install_flashinfer_sources


def _fingerprint(cli, tree, *env_args) -> str:
    result = cli("status", "--fingerprint", "--site-packages", tree)
    assert result.code == 0, result.stderr
    (line,) = result.stdout.splitlines()
    return line


def _every_way(cli, tree) -> set[str]:
    """The tree's fingerprint as status --fingerprint, status --json (a full judgement) and verify --json give it."""
    found = {_fingerprint(cli, tree), cli("status", "--json", "--site-packages", tree).json()["fingerprint"]}
    verify = cli("verify", "--json", "--site-packages", tree)
    if verify.json()["fingerprint"] is not None:
        found.add(verify.json()["fingerprint"])
    return found


@pytest.mark.parametrize("version", ["0.28.0", "0.30.0", "0.33.0"])
@pytest.mark.parametrize("opt_in", [[], ["--with", "aux-streams"]], ids=["default", "aux-streams"])
def test_copies_at_other_paths_have_one_fingerprint_however_it_is_made(version, opt_in, make_tree, cli):
    first, second = make_tree(version), make_tree(version)
    pristine = _every_way(cli, first)
    assert len(pristine) == 1 and pristine == _every_way(cli, second)
    applied = cli("apply", "--json", "--site-packages", first, *opt_in)
    assert applied.code == 0, applied.stderr
    assert cli("apply", "--site-packages", second, *opt_in).code == 0
    after = _every_way(cli, first)
    assert after == {applied.json()["fingerprint"]} == _every_way(cli, second)
    assert after != pristine or version == "0.33.0" and not opt_in  # 0.33.0 needs nothing but opt-ins


def test_the_files_are_those_the_judgement_read(make_tree, cli):
    """Derived from the judgement, not listed: a pristine known build's are the files anchors/ recorded."""
    tree = make_tree("0.30.0")
    parsed = serving.Parsed(_fingerprint(cli, tree))
    record = quick.anchors_record("0.30.0")
    assert len(parsed.files) == len(record["files"]) > 5
    site = quick.locate([str(tree)])
    assert sorted(serving.of_recorded(site, quick.known_judgement(site)).files) == sorted(record["files"])


def _expect(cli, tree, fingerprint: str, *more):
    """verify --expect; its stderr with the lines folded to 80 columns joined again (tests/errors.py)."""
    from dataclasses import replace

    result = cli("verify", "--site-packages", tree, "--expect", fingerprint, *more)
    assert all(fits(line) for line in result.stderr.splitlines()), result.stderr
    return replace(result, stderr=result.stderr.replace("\npatch-dsv4:   ", " "))


def test_one_opt_in_makes_another_fingerprint_and_verify_expect_says_so_both_ways(make_tree, cli):
    plain, aux = make_tree("0.30.0"), make_tree("0.30.0")
    assert cli("apply", "--site-packages", plain).code == 0
    assert cli("apply", "--site-packages", aux, "--with", "aux-streams").code == 0
    fp_plain, fp_aux = _fingerprint(cli, plain), _fingerprint(cli, aux)
    assert fp_plain != fp_aux

    there = _expect(cli, plain, fp_aux)
    assert there.code == 1
    assert "opt-ins: aux-streams there, none here" in there.stderr
    assert "aux-streams: applied there, opt-in here" in there.stderr
    assert "nvidia/model.py: another sha256 there" in there.stderr
    back = _expect(cli, aux, fp_plain)
    assert back.code == 1
    assert "opt-ins: none there, aux-streams here" in back.stderr
    assert "aux-streams: opt-in there, applied here" in back.stderr

    for tree, fp in ((plain, fp_plain), (aux, fp_aux)):
        same = _expect(cli, tree, fp, "--json")
        assert same.code == 0 and "the fingerprint is the expected one" in same.json()["notes"]
    document = _expect(cli, plain, fp_aux, "--json").json()
    assert document["exit_code"] == 1 and any("opt-ins" in n for n in document["notes"])


def test_one_byte_in_a_file_judged_from_makes_another_fingerprint_naming_that_file(make_tree, cli):
    tree, other = make_tree("0.30.0"), make_tree("0.30.0")
    before = _fingerprint(cli, tree)
    path = other / "vllm/v1/attention/backends/mla/sparse_swa.py"  # judged from (wide-swa), never edited
    hand_edit(path, path.read_text() + "#")
    after = _fingerprint(cli, other)
    assert after != before
    result = _expect(cli, other, before)
    assert result.code == 1
    assert "vllm/v1/attention/backends/mla/sparse_swa.py: another sha256 there" in result.stderr
    assert "vLLM" not in result.stderr.split("differs from the expected one: ")[1].split(":")[0]


def test_another_flashinfer_build_and_release_make_other_fingerprints(make_tree, cli):
    base = make_tree("0.30.0")
    fp = _fingerprint(cli, base)

    flashinfer = make_tree("0.30.0")
    install_flashinfer_sources(flashinfer, "0.7.0.post1")
    result = _expect(cli, flashinfer, fp)
    assert result.code == 1 and "FlashInfer 0.6.18.post1-pinned there, 0.7.0.post1 here" in result.stderr

    build = make_tree("0.30.0")
    wheel = next(build.glob("vllm-*.dist-info")) / "WHEEL"
    wheel.write_text(wheel.read_text().replace("linux_x86_64", "linux_aarch64"))
    result = _expect(cli, build, fp)
    assert result.code == 1 and "vLLM build: another 0.30.0 build there" in result.stderr

    release = make_tree("0.31.0")
    result = _expect(cli, release, fp)
    assert result.code == 1 and "vLLM 0.30.0 there, 0.31.0 here" in result.stderr
    assert "files judged from differ" in result.stderr and "another sha256 there" not in result.stderr
    assert len({fp, _fingerprint(cli, flashinfer), _fingerprint(cli, build), _fingerprint(cli, release)}) == 4


@pytest.mark.parametrize("bad", ["", "abc", "dsv4:2:x", "dsv4:1:short:vllm-1:fi-none:aaaaaaaa::"])
def test_expect_of_something_else_is_a_usage_error(bad, make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    result = cli("verify", "--site-packages", tree, "--expect", bad)
    assert result.code == 2 and "is no fingerprint" in error_lines(result.stderr)[0]


def test_verify_expect_on_an_applied_tree_stays_on_the_fast_path(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    fp = _fingerprint(cli, tree)
    result, heavy = _fresh_verify(tree, "--expect", fp)
    assert result.returncode == 0 and "hashes match the recorded state" in result.stdout and heavy == []
    other = fp.replace(fp.split(":")[2], "a" * 12)
    result, heavy = _fresh_verify(tree, "--expect", other)
    assert result.returncode == 1 and heavy == []


# -- PATCH_DSV4_WITH -------------------------------------------------------------------------
def _state(tree) -> dict:
    manifest = json.loads((tree / ".patch-dsv4" / "manifest.json").read_text())
    return {k: manifest[k] for k in ("files", "verdicts", "inputs", "opt_in", "flashinfer")}


def test_patch_dsv4_with_gives_the_state_with_gives(make_tree, cli, monkeypatch):
    by_option, by_env = make_tree("0.30.0"), make_tree("0.30.0")
    assert cli("apply", "--site-packages", by_option, "--with", "aux-streams", "--with", "dense-exl3").code == 0
    monkeypatch.setenv(serving.ENV_WITH, "aux-streams,dense-exl3")
    assert cli("apply", "--site-packages", by_env).code == 0
    assert _state(by_env) == _state(by_option)
    assert _state(by_env)["opt_in"] == ["aux-streams", "dense-exl3"]
    assert _fingerprint(cli, by_env) == _fingerprint(cli, by_option)
    monkeypatch.delenv(serving.ENV_WITH)
    assert cli("verify", "--site-packages", by_env).code == 0  # the state says what was asked for


def test_patch_dsv4_with_and_with_add_up_for_takeover_too(make_tree, cli, monkeypatch):
    tree = make_tree("0.30.0")
    monkeypatch.setenv(serving.ENV_WITH, "aux-streams")
    assert cli("takeover", "--site-packages", tree, "--with", "dense-exl3").code == 0
    assert _state(tree)["opt_in"] == ["aux-streams", "dense-exl3"]


def test_verify_needs_the_opt_ins_patch_dsv4_with_names(make_tree, cli, monkeypatch):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    monkeypatch.setenv(serving.ENV_WITH, "aux-streams")
    result = cli("verify", "--site-packages", tree)
    assert result.code == 1 and "aux-streams is pending" in result.stderr
    assert cli("apply", "--site-packages", tree).code == 0
    assert cli("verify", "--site-packages", tree).code == 0
    result, heavy = _fresh_verify(tree)  # PATCH_DSV4_WITH is inherited: kept by the state, so the fast path
    assert result.returncode == 0 and "hashes match the recorded state" in result.stdout and heavy == []


@pytest.mark.parametrize("command", ["apply", "verify", "takeover"])
def test_an_unknown_opt_in_in_patch_dsv4_with_is_a_usage_error(command, make_tree, cli, monkeypatch):
    tree = make_tree("0.30.0")
    monkeypatch.setenv(serving.ENV_WITH, "aux-streams, no-such-patch")
    result = cli(command, "--site-packages", tree)
    assert result.code == 2
    (said,) = error_lines(result.stderr)
    assert "PATCH_DSV4_WITH=aux-streams,no-such-patch: no opt-in patch no-such-patch" in said
    assert "aux-streams, dense-exl3, exl3-wo-a-slices" in said
    assert not (tree / ".patch-dsv4").exists()


# -- the guard with PATCH_DSV4_EXPECT ----------------------------------------------------------
def _records(caplog):
    return [r for r in caplog.records if r.name == "vllm.patch_dsv4"]


def test_the_guard_compares_patch_dsv4_expect(make_tree, cli, running, monkeypatch, caplog):
    plain, aux = make_tree("0.30.0"), make_tree("0.30.0")
    assert cli("apply", "--site-packages", plain).code == 0
    assert cli("apply", "--site-packages", aux, "--with", "aux-streams").code == 0
    fp_plain, fp_aux = _fingerprint(cli, plain), _fingerprint(cli, aux)

    running(plain)
    monkeypatch.setenv(serving.ENV_EXPECT, fp_plain)
    monkeypatch.setenv(guard.ENV, "strict")
    with caplog.at_level(logging.DEBUG, logger="vllm.patch_dsv4"):
        guard.check()  # equal: silent, the fingerprint at DEBUG
    (record,) = _records(caplog)
    assert record.levelno == logging.DEBUG and fp_plain in record.getMessage()
    caplog.clear()

    monkeypatch.setenv(serving.ENV_EXPECT, fp_aux)
    with pytest.raises(guard.PatchesNotInPlace, match="opt-ins: aux-streams there, none here"):
        guard.check()
    monkeypatch.setenv(guard.ENV, "warn")
    with caplog.at_level(logging.DEBUG, logger="vllm.patch_dsv4"):
        guard.check()
    errors = [r for r in _records(caplog) if r.levelno == logging.ERROR]
    assert len(errors) == 1
    message = errors[0].getMessage()
    assert "not the tree PATCH_DSV4_EXPECT names" in message and "aux-streams: applied there, opt-in here" in message
    assert "\n" not in message


def test_the_guard_says_patch_dsv4_expect_is_no_fingerprint(make_tree, cli, running, monkeypatch):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    running(tree)
    monkeypatch.setenv(serving.ENV_EXPECT, "not-a-fingerprint")
    monkeypatch.setenv(guard.ENV, "strict")
    with pytest.raises(guard.PatchesNotInPlace, match="PATCH_DSV4_EXPECT cannot be compared"):
        guard.check()


def test_verbose_text_shows_the_fingerprint_within_80_columns_and_names_where_it_is_whole(make_tree, cli):
    """-v shows the fingerprint's head on a line of its own (within 80 columns) and says that status
    --fingerprint prints it whole; the head is the whole one's, before and after apply."""
    tree = make_tree("0.30.0")
    fp = _fingerprint(cli, tree)
    applied = cli("apply", "--site-packages", tree, "-v")
    after = _fingerprint(cli, tree)
    assert after != fp
    for result in (cli("status", "--site-packages", tree, "-v"), applied, cli("verify", "--site-packages", tree, "-v")):
        lines = result.stdout.splitlines()
        (head,) = [line.strip() for line in lines if line.strip().startswith("dsv4:")]
        assert head.endswith("...") and after.startswith(head.removesuffix("...")) and len(head) > 40, head
        assert any("status --fingerprint prints it whole" in line for line in lines)
        assert all(fits(line) for line in lines), result.stdout
    assert fp[:40] not in cli("status", "--site-packages", tree).stdout  # only with -v
