"""No traceback, ever, on bad input: options, interpreters and targets a command cannot use are each one
clear line on stderr, with exit 2 where the environment cannot be used."""

from __future__ import annotations

import json
import sys

import pytest

from tests.errors import exit_2_line as _error
from tests.errors import one_line as _one_line
from tests.releases import stat_snapshot


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


def test_directory_without_vllm(tmp_path, cli):
    result = cli("status", "--site-packages", tmp_path)
    assert result.code == 2
    assert "no vLLM in" in _one_line(result.stderr)
    assert _one_line(result.stderr).endswith(
        f"(next: {sys.executable} -m pip show vllm (its Location:, where vLLM is installed for that Python))"
    )
    missing = cli("apply", "--site-packages", tmp_path / "nope")
    assert missing.code == 2
    assert "is not a directory" in _one_line(missing.stderr)
    # next: a command that says where vLLM is installed
    assert _one_line(missing.stderr).endswith(
        f"(next: {sys.executable} -m pip show vllm (its Location:, where vLLM is installed for that Python))"
    )


def test_a_wheel_that_is_not_there_gets_the_command_that_fetches_one(tmp_path, cli):
    """drift --wheel FILE that does not exist: next fetches the release its name gives, else the newest recorded."""
    from patch_dsv4.releases.anchors_store import recorded_versions

    named = cli("drift", "--wheel", tmp_path / "vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    assert named.code == 2
    assert _one_line(named.stderr).endswith("(next: patch-dsv4 drift --vllm-version 0.31.0 (pip fetches its wheel))")
    unnamed = cli("drift", "--wheel", tmp_path / "nope.whl")
    newest = recorded_versions()[-1]
    assert _one_line(unnamed.stderr).endswith(
        f"(next: patch-dsv4 drift --vllm-version {newest} (pip fetches its wheel))"
    )


def test_a_release_pip_cannot_fetch_gets_the_command_that_lists_what_it_serves(tmp_path, cli):
    result = cli("drift", "--vllm-version", "0.0.1", "--pip-option=--no-index", "--cache-dir", tmp_path, "-q")
    assert result.code == 2
    assert _one_line(result.stderr).endswith(
        f"(next: {sys.executable} -m pip index versions vllm (the releases pip's index serves), or pass --wheel FILE)"
    )


def test_json_errors_are_json(tmp_path, cli):
    result = cli("verify", "--site-packages", tmp_path, "--json")
    assert result.code == 2
    assert json.loads(result.stdout)["exit_code"] == 2


def _fake_vllm(root, version="0.27.0"):
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    dist = root / f"vllm-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n\n")
    (dist / "RECORD").write_text("vllm/__init__.py,sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU,0\n")
    return root


def test_vllm_without_deepseek_v4(tmp_path, cli):
    root = _fake_vllm(tmp_path / "sp")
    before = stat_snapshot(root)
    status = cli("status", "--site-packages", root, "--json")
    assert status.code == 0
    assert set(status.verdicts().values()) == {"not-applicable"}
    assert status.json()["flashinfer_source"] is None
    assert cli("apply", "--site-packages", root).code == 0
    assert cli("verify", "--site-packages", root).code == 0
    assert stat_snapshot(root) == before


def test_unknown_patch_id(make_tree, cli):
    tree = make_tree("0.30.0")
    result = cli("apply", "--site-packages", tree, "--only", "no-such-patch")
    assert result.code == 2
    assert "--only no-such-patch: no patch no-such-patch" in _one_line(result.stderr)
