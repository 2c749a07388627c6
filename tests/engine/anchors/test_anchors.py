"""anchors/: the committed records agree with a fresh computation from the real wheels; status's known-build check."""

from __future__ import annotations

import hashlib
import json

import pytest

from patch_dsv4.pipeline.drift import record
from patch_dsv4.releases import anchors_store
from patch_dsv4.releases.anchors_store import known_release, recorded_files
from patch_dsv4.releases.release_target import open_wheel
from tests.cli.test_bad_input import _fake_vllm
from tests.conftest import RELEASE_PARAMS
from tests.releases import DSV4, RELEASES, cache_dir, hand_edit, wheel

WHEELS = str(cache_dir() / "wheels")
RERECORD = f"{anchors_store.RECORD_COMMAND} --cache-dir {WHEELS}"


def test_every_release_is_recorded():
    assert anchors_store.recorded_versions() == list(RELEASES), f"re-record with: {RERECORD}"


@pytest.mark.parametrize("version", RELEASE_PARAMS)
def test_recorded_anchors_agree_with_the_wheel(version):
    def text(path):
        return path.read_text(encoding="utf-8") if path.exists() else "(missing)"

    committed = text(anchors_store.anchors_path(version)), text(anchors_store.probes_path(version))
    with open_wheel(wheel("vllm", version)) as target:
        main, probes = anchors_store.split(record(target, wheel_name=wheel("vllm", version).name))
    fresh = anchors_store.dumps(main), anchors_store.dumps(probes)
    assert committed == fresh, (
        f"anchors/vllm-{version}.json differs from a fresh record of the wheel (a patch or the engine changed "
        f"what it records). If the change is intended, re-record with: {RERECORD}"
    )


def test_record_is_deterministic_json():
    text = anchors_store.anchors_path("0.30.0").read_text()
    assert anchors_store.dumps(json.loads(text)) == text


def test_record_and_check_commands(tmp_path, cli):
    out = tmp_path / "anchors"
    result = cli("anchors", "record", "--vllm-version", "0.30.0", "--cache-dir", WHEELS, "--out", out)
    assert result.code == 0, result.stderr
    assert (out / "vllm-0.30.0.json").read_text() == anchors_store.anchors_path("0.30.0").read_text()
    check = cli("anchors", "record", "--all", "--check", "--cache-dir", WHEELS, "--out", out)
    assert check.code == 0 and "up to date" in check.stdout
    data = json.loads((out / "vllm-0.30.0.json").read_text())
    data["files"][next(iter(data["files"]))] = "0" * 64
    (out / "vllm-0.30.0.json").write_text(anchors_store.dumps(data))
    stale = cli("anchors", "record", "--all", "--check", "--cache-dir", WHEELS, "--out", out)
    assert stale.code == 1 and anchors_store.RECORD_COMMAND in stale.stdout
    nothing = cli("anchors", "record", "--out", tmp_path / "empty")
    assert nothing.code == 2 and "--vllm-version" in nothing.stderr


@pytest.mark.parametrize("version", RELEASE_PARAMS)
def test_known_release_tells_known_from_unknown(version, make_tree):
    tree = make_tree(version)

    def sha(rel):
        path = tree / rel
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None

    match = known_release(version, sha)
    assert match.known and bool(match), match.detail
    assert known_release(version, {rel: sha(rel) for rel in recorded_files(version)})  # a mapping works too
    assert not known_release("0.0.1", sha)
    assert "no anchors recorded" in known_release("0.0.1", sha).detail

    # Only DSV4 is a real copy in a test tree: elsewhere a write would reach the shared cache.
    files = anchors_store.load(version)["files"]
    target = next(rel for rel in sorted(files) if rel.startswith(DSV4 + "/"))
    path = tree / target
    assert not any(p.is_symlink() for p in (path, *path.parents))
    if files[target] is None:  # absent from the release: a build that ships it is another build
        path.write_text("# a file this release does not have\n")
    else:
        hand_edit(path, path.read_text() + "\n# a hand edit\n")
    unknown = known_release(version, sha)
    assert not unknown and unknown.mismatched == (target,) and target in unknown.detail


@pytest.mark.parametrize("version", RELEASE_PARAMS)
def test_recalled_probe_answers_are_what_the_probes_answer(version, make_tree, cli, monkeypatch):
    """On a release's own bytes, status recalls its probes' answers from the record: the same report as the
    probes running (each answer is recalled only where every file its probe read hashes as recorded)."""
    from patch_dsv4.patching.patch import Context

    tree = make_tree(version)
    recalled = cli("status", "--site-packages", tree, "--json").json()
    misses = []

    def run_instead(self, key):
        misses.append(key)
        return False, None

    monkeypatch.setattr(Context, "recall", run_instead)
    computed = cli("status", "--site-packages", tree, "--json").json()
    assert misses and recalled == computed


def test_a_changed_file_is_judged_not_recalled(make_tree, cli):
    """A file a probe read that differs from the release's (re-released: RECORD matches it) makes that probe run."""
    tree = make_tree("0.34.0")
    path = tree / "vllm/models/deepseek_v4/nvidia/ops/o_proj.py"
    old = "use_fp8 = wo_a.weight.dtype == torch.float8_e4m3fn"
    hand_edit(path, path.read_text().replace(old, "use_fp8 = wo_a.weight.dtype != torch.float8_e4m3fn"))
    from tests.releases import rewrite_record

    rewrite_record(tree, ["vllm/models/deepseek_v4/nvidia/ops/o_proj.py"])
    patch = cli("status", "--site-packages", tree, "--json").patch("dtype-policy")
    assert patch["verdict"] == "drifted"  # recorded: upstream; computed on these bytes: the sense is inverted


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
