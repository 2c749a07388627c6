"""DeepSeek-V4.1 on the real releases 0.30.0-0.34.0, in the release layout (``deepseek_v41/``) and the nightly
one (``deepseek_v4_1/``, built by tests/v41_trees.py): each V4.1 edit's verdict before apply, apply, verify, a
second apply that changes nothing, revert byte for byte; V4's edits keep the verdicts anchors/ records."""

from __future__ import annotations

import pytest

from patch_dsv4.releases import anchors_store
from tests.releases import content_snapshot
from tests.v41_trees import NIGHTLY_PACKAGE, RELEASE_PACKAGE, nightly_layout

#: (patch, V4.1 file relative to its package) -> verdict per release, as the code of each release earns it.
EXPECTED = {
    ("stream-load", "nvidia/vl_model.py"): ("pending", "pending", "pending", "upstream", "upstream"),
    ("stream-load", "amd/vl_model.py"): ("pending", "pending", "pending", "upstream", "upstream"),
    ("aux-streams", "nvidia/model.py"): ("pending",) * 5,
    ("wide-swa", "nvidia/flashinfer_sparse.py"): ("pending",) + ("not-applicable",) * 4,
    ("dtype-policy", "nvidia/flashinfer_sparse.py"): ("upstream",) * 5,
    ("dtype-policy", "nvidia/flashmla.py"): ("upstream",) * 5,
    ("loader-skips", "nvidia/model.py"): ("upstream",) * 5,
    ("exl3-wo-a-slices", "nvidia/model.py"): ("pending",) * 5,
}
VERSIONS = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")


def _edits(document: dict, package: str) -> dict[tuple[str, str], set[str]]:
    found: dict[tuple[str, str], set[str]] = {}
    for patch in document["patches"]:
        for edit in patch["edits"]:
            if edit["file"].startswith(package + "/"):
                found.setdefault((patch["id"], edit["file"][len(package) + 1 :]), set()).add(edit["verdict"])
    return found


def _v4_edits(document: dict) -> dict[tuple[str, str, str], str]:
    """(patch, file, scope) -> verdict of V4's edits (files outside the V4.1 packages)."""
    return {
        (p["id"], e["file"], e["scope"]): e["verdict"]
        for p in document["patches"]
        for e in p["edits"]
        if "/deepseek_v41/" not in e["file"] and "/deepseek_v4_1/" not in e["file"]
    }


@pytest.mark.parametrize("layout", ["release", "nightly"])
@pytest.mark.parametrize("version", VERSIONS)
def test_v41_lifecycle(version, layout, make_tree, cli):
    tree = make_tree(version)
    package = RELEASE_PACKAGE
    if layout == "nightly":
        nightly_layout(tree)
        package = NIGHTLY_PACKAGE
    original = {**content_snapshot(tree), **content_snapshot(tree, package)}
    status = cli("status", "--site-packages", tree, "--json")
    assert status.code in (0, 1), status.stderr
    found = _edits(status.json(), package)
    column = VERSIONS.index(version)
    for key, verdicts in EXPECTED.items():
        assert found[key] == {verdicts[column]}, (key, found[key])
    for edits in _edits(status.json(), NIGHTLY_PACKAGE if layout == "release" else RELEASE_PACKAGE).values():
        assert edits == {"not-applicable"}  # the other layout's files are not there
    recorded = {
        (patch_id, a["file"], a["scope"]): a["verdict"]
        for patch_id, patch in anchors_store.load(version)["patches"].items()
        for a in patch["anchors"]
    }
    for key, verdict in _v4_edits(status.json()).items():
        if key in recorded and layout == "release":
            assert verdict == recorded[key], key

    applied = cli("apply", "--site-packages", tree, "--with", "aux-streams", "--with", "exl3-wo-a-slices", "--json")
    assert applied.code == 0, applied.stderr
    after = _edits(applied.json(), package)
    for key, verdicts in EXPECTED.items():
        want = "applied" if verdicts[column] == "pending" else verdicts[column]
        assert after[key] == {want}, (key, after[key])
    assert cli("verify", "--site-packages", tree).code == 0
    again = cli("apply", "--site-packages", tree, "--json")
    assert again.code == 0 and again.json()["changed_files"] == []
    assert cli("revert", "--site-packages", tree).code == 0
    assert {**content_snapshot(tree), **content_snapshot(tree, package)} == original


V41_VL_MODEL = f"{RELEASE_PACKAGE}/nvidia/vl_model.py"


def test_drift_reports_the_v41_anchors(tmp_path, cli):
    """The recorded V4.1 fingerprints: a change around the anchor is new, a change of the anchor drifts."""
    from tests.engine.anchors.test_drift import _replace_once, mini_wheel

    (tmp_path / "around").mkdir()
    around = mini_wheel(
        "0.30.0",
        tmp_path / "around",
        _replace_once(
            V41_VL_MODEL, "loader = AutoWeightsLoader(self)", "loader = AutoWeightsLoader(self, skip_prefixes=[])"
        ),
    )
    data = cli("drift", "--wheel", around, "--json").json()
    (patch,) = [p for p in data["patches"] if p["id"] == "stream-load"]
    assert patch["verdict"] == "pending"
    (anchor,) = [a for a in patch["anchors"] if a["file"] == V41_VL_MODEL]
    assert anchor["status"] == "new"
    assert cli("drift", "--wheel", around, "--strict", "--json").code == 1

    (tmp_path / "anchor").mkdir()
    changed = mini_wheel("0.30.0", tmp_path / "anchor", _replace_once(V41_VL_MODEL, "key=lambda x: x[0]", "key=str"))
    result = cli("drift", "--wheel", changed, "--json")
    assert result.code == 1
    (patch,) = [p for p in result.json()["patches"] if p["id"] == "stream-load"]
    assert patch["verdict"] == "drifted"
    (edit,) = [e for e in patch["edits"] if e["file"] == V41_VL_MODEL]
    assert edit["verdict"] == "drifted" and "key=str" in edit["found"]
    # V4's own edit keeps its verdict
    assert {e["verdict"] for e in patch["edits"] if e["file"] == "vllm/models/deepseek_v4/common/vl_model.py"} == {
        "pending"
    }


def test_the_guard_checks_the_v41_files(make_tree, cli, monkeypatch):
    import sys
    import types

    from patch_dsv4 import guard
    from tests.releases import hand_edit

    def running(tree):
        module = types.ModuleType("vllm")
        module.__file__ = str(tree / "vllm" / "__init__.py")
        monkeypatch.setitem(sys.modules, "vllm", module)
        monkeypatch.setattr(guard, "_reported", False)

    monkeypatch.setenv(guard.ENV, "strict")
    tree = make_tree("0.30.0")
    assert cli("apply", "--site-packages", tree).code == 0
    running(tree)
    guard.check()  # applied, V4.1 included: silent
    hand_edit(tree / V41_VL_MODEL, (tree / V41_VL_MODEL).read_text() + "\n# a local edit\n")
    with pytest.raises(guard.PatchesNotInPlace, match=r"stream-load is modified \([^)]*deepseek_v41/nvidia/vl_model"):
        guard.check()

    nightly = nightly_layout(make_tree("0.30.0"))  # not a recorded build: judged in full
    running(nightly)
    with pytest.raises(guard.PatchesNotInPlace, match=r"stream-load is pending \([^)]*deepseek_v4_1/nvidia/vl_model"):
        guard.check()
