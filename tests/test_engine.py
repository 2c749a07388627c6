"""The engine's promises on bad input: clear one-line errors, the right exit status, nothing lost."""

from __future__ import annotations

import json

import pytest

from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patches.stream_load import VL_MODEL
from patch_dsv4.patching.patch import Edit, Patch, Scope
from patch_dsv4.pipeline import commands
from tests.errors import error_lines
from tests.releases import hand_edit, stat_snapshot


def _one_line(stderr: str) -> str:
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_directory_without_vllm(tmp_path, cli):
    result = cli("status", "--site-packages", tmp_path)
    assert result.code == 2
    assert "no vLLM in" in _one_line(result.stderr)
    missing = cli("apply", "--site-packages", tmp_path / "nope")
    assert missing.code == 2
    assert "is not a directory" in _one_line(missing.stderr)


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


@pytest.mark.parametrize("damage", ["truncated", "not-utf8", "wrong-schema"])
def test_damaged_state_is_exit_2_for_status_and_verify_and_apply_rebuilds_it(damage, make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    manifest = tree / ".patch-dsv4" / "manifest.json"
    data = manifest.read_bytes()
    if damage == "truncated":
        manifest.write_bytes(data[: len(data) // 2])
    elif damage == "not-utf8":
        manifest.write_bytes(b"\xff\xfe" + data)
    else:
        manifest.write_text(json.dumps({**json.loads(data), "schema": 99}))
    before = stat_snapshot(tree)
    for command in ("status", "verify"):
        result = cli(command, "--site-packages", tree)
        assert result.code == 2, (command, result.stdout, result.stderr)
        line = _one_line(result.stderr)
        assert "unreadable state" in line and f"(next: patch-dsv4 apply --site-packages {tree} (rebuilds" in line
    assert stat_snapshot(tree) == before
    rebuilt = cli("apply", "--site-packages", tree, "--json")
    assert rebuilt.code == 0 and rebuilt.json()["notes"][0].startswith("rebuilt the state (5 file(s), vLLM 0.30.0)")
    assert cli("verify", "--site-packages", tree).code == 0


def test_hand_changed_file_refused_unless_force(make_tree, cli):
    tree = make_tree("0.30.0")
    target = tree / VL_MODEL
    edited = target.read_text() + "\n# a local hotfix\n"
    hand_edit(target, edited)
    before = stat_snapshot(tree)
    refused = cli("apply", "--site-packages", tree)
    assert refused.code == 1
    line = _one_line(refused.stderr)
    assert VL_MODEL in line and "RECORD" in line and "--force" in line
    assert stat_snapshot(tree) == before

    forced = cli("apply", "--site-packages", tree, "--force", "--json")
    assert forced.code == 0
    assert forced.verdicts()["stream-load"] == "applied"
    assert cli("revert", "--site-packages", tree).code == 0
    assert target.read_text() == edited  # the backup is what was there, hotfix included


def test_patched_file_changed_before_revert_is_kept(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    target = tree / VL_MODEL
    edited = target.read_text().replace("# patch-dsv4 (stream-load)", "# patch-dsv4 (stream-load) reviewed")
    hand_edit(target, edited)
    status = cli("status", "--site-packages", tree, "--json")
    assert status.verdicts()["stream-load"] == "modified"
    assert cli("verify", "--site-packages", tree).code == 1
    before = stat_snapshot(tree)
    refused = cli("revert", "--site-packages", tree)
    assert refused.code == 1
    assert "refusing to revert" in _one_line(refused.stderr)
    assert cli("apply", "--site-packages", tree).code == 1
    assert stat_snapshot(tree) == before
    assert target.read_text() == edited


class _Appending(Edit):
    """A broken transform: every run appends again."""

    label = "append forever"
    file = VL_MODEL
    scope = Scope("DeepseekV4ForConditionalGeneration", None)

    def evaluate(self, ctx, text):
        return Outcome(Verdict.PENDING, "always pending", variant=0)

    def rewrite(self, module, outcome):
        import libcst as cst

        return module.with_changes(body=[*module.body, *cst.parse_module("X = 1\n").body])

    def injected_code(self, outcome):
        return ()


class _NotIdempotent(Patch):
    """Test patch whose transform is not idempotent."""

    id = "not-idempotent"
    title = "test"
    edits = (_Appending(),)


def test_non_idempotent_transform_caught_before_writing(make_tree, cli, monkeypatch):
    monkeypatch.setattr(commands, "discover_patches", lambda: [_NotIdempotent()])
    tree = make_tree("0.30.0")
    before = stat_snapshot(tree)
    result = cli("apply", "--site-packages", tree)
    assert result.code == 2
    assert "not idempotent" in _one_line(result.stderr)
    assert stat_snapshot(tree) == before


def test_dry_run_prints_diff_and_writes_nothing(make_tree, cli):
    tree = make_tree("0.31.0")
    before = stat_snapshot(tree)
    result = cli("apply", "--site-packages", tree, "--dry-run")
    assert result.code == 0
    assert f"+++ b/{VL_MODEL}" in result.stdout
    assert "+            mapped = _patch_dsv4_stream_language_model_first(mapped)" in result.stdout
    assert stat_snapshot(tree) == before
    assert not (tree / ".patch-dsv4").exists() and not (tree / ".patch-dsv4.lock").exists()


def test_unknown_patch_id(make_tree, cli):
    tree = make_tree("0.30.0")
    result = cli("apply", "--site-packages", tree, "--only", "no-such-patch")
    assert result.code == 2
    assert "--only no-such-patch: no patch no-such-patch" in _one_line(result.stderr)


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


@pytest.mark.parametrize("version,problem", [("0.28.0", False), ("0.29.0", True)])
def test_injected_constructor_call_binds_to_the_release(version, problem, make_tree):
    """0.29.0 dropped AutoWeightsLoader's skip_substrs: injected code using it must not fit there."""
    from patch_dsv4.patching.resolve import check_injected
    from patch_dsv4.pipeline.reading import context_for
    from patch_dsv4.tree.environment import locate_vllm

    env = locate_vllm(make_tree(version))
    code = "loader = AutoWeightsLoader(self, skip_substrs=['mtp.'])"
    problems = check_injected(context_for(env), "vllm/models/deepseek_v4/nvidia/model.py", [code], {"self"})
    assert bool(problems) == problem, problems
    if problem:
        assert "AutoWeightsLoader" in problems[0] and "skip_substrs" in problems[0]
    fits = "loader = AutoWeightsLoader(self, ignore_unexpected_prefixes=['vision.'])"
    assert check_injected(context_for(env), "vllm/models/deepseek_v4/nvidia/model.py", [fits], {"self"}) == []


def test_status_tells_builds_from_unknown_ones(make_tree, cli):
    tree = make_tree("0.30.0")
    build = cli("status", "--site-packages", tree, "--json").json()["build"]
    assert build["known"] is True and "anchors/vllm-0.30.0.json" in build["detail"]
    assert cli("apply", "--site-packages", tree).code == 0
    # our own edits do not make the build unknown: patched files count as installed
    assert cli("status", "--site-packages", tree, "--json").json()["build"]["known"] is True
    other = tree / "vllm/models/deepseek_v4/nvidia/model.py"
    hand_edit(other, other.read_text() + "\n# a local build\n")
    build = cli("status", "--site-packages", tree, "--json").json()["build"]
    assert build["known"] is False and "nvidia/model.py" in build["detail"]


def test_status_of_an_unrecorded_release_is_unknown(tmp_path, cli):
    root = _fake_vllm(tmp_path / "sp", version="0.27.5")
    build = cli("status", "--site-packages", root, "--json").json()["build"]
    assert build["known"] is False and "no anchors recorded for vLLM 0.27.5" in build["detail"]
