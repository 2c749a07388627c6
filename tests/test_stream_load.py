"""stream-load on the real releases: its scope, its evidence, and drift (numerics in test_stream_load_torch.py)."""

from __future__ import annotations

import shutil

import pytest

from patch_dsv4.patches.stream_load import VL_MODEL
from tests.errors import error_lines
from tests.records import recorded_verdict, releases_needing
from tests.releases import RELEASES, hand_edit, rewrite_record, stat_snapshot

HELPER = "_patch_dsv4_stream_language_model_first"


@pytest.mark.parametrize("version", [v for v in RELEASES if recorded_verdict(v, "stream-load") == "upstream"])
def test_upstream_names_its_evidence(version, make_tree, cli):
    patch = cli("status", "--site-packages", make_tree(version), "--json").patch("stream-load")
    assert patch["verdict"] == "upstream" and "stream_language_model_first" in patch["detail"]


@pytest.mark.parametrize("version", releases_needing("stream-load"))
def test_only_the_vision_class_method_changes(version, make_tree, cli):
    """V4's vision class and V4.1's (nvidia/ and amd/), not the nvidia/vl_model.py shim, not another method."""
    tree = make_tree(version)
    before = stat_snapshot(tree)
    result = cli("apply", "--site-packages", tree, "--only", "stream-load", "--json")
    assert result.code == 0, result.stderr
    after = stat_snapshot(tree)
    changed = {f for f in after if before.get(f) != after[f] and not f.startswith(".patch-dsv4")}
    v41 = {f"vllm/models/deepseek_v41/{vendor}/vl_model.py" for vendor in ("nvidia", "amd")}
    assert changed == {VL_MODEL, *v41}
    text = (tree / VL_MODEL).read_text()
    assert text.count(f"{HELPER}(mapped)") == 1
    assert "iter(sorted(mapped" not in text
    for rel in v41:
        text = (tree / rel).read_text()
        assert text.count(f"{HELPER}(self.hf_to_vllm_mapper.apply(weights))") == 1
        assert "sorted(" not in text


def test_recognised_as_ours_without_state(make_tree, cli):
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    shutil.rmtree(tree / ".patch-dsv4")
    result = cli("status", "--site-packages", tree, "--json")
    assert result.verdicts()["stream-load"] == "applied"
    assert result.json()["state"] == "none"


@pytest.mark.parametrize("version", ["0.30.0", "0.32.0"])
def test_changed_anchor_is_drifted_and_nothing_written(version, make_tree, cli):
    tree = make_tree(version)
    path = tree / VL_MODEL
    hand_edit(path, path.read_text().replace("key=lambda x: x[0]", "key=lambda item: item[0]"))
    rewrite_record(tree, [VL_MODEL])  # a release that really ships this code
    before = stat_snapshot(tree)
    status = cli("status", "--site-packages", tree, "--json")
    patch = status.patch("stream-load")
    assert patch["verdict"] == "drifted"
    (edit,) = [e for e in patch["edits"] if e["file"] == VL_MODEL]
    assert "iter(sorted(mapped, key=lambda x: x[0]))" in edit["expected"]
    assert "lambda item: item[0]" in edit["found"]
    applied = cli("apply", "--site-packages", tree)
    assert applied.code == 1
    assert "stream-load is drifted" in applied.stderr
    assert len(error_lines(applied.stderr)) == 1
    assert stat_snapshot(tree) == before


# -- the injected generator, executed on CPU torch ---------------------------------
