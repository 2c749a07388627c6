"""DeepSeek-V4.1 on the real releases 0.30.0-0.33.0, in the release layout (``deepseek_v41/``) and the nightly
one (``deepseek_v4_1/``, built by tests/v41_trees.py): each V4.1 edit's verdict before apply, apply, verify, a
second apply that changes nothing, revert byte for byte; V4's edits keep the verdicts anchors/ records."""

from __future__ import annotations

import pytest

from patch_dsv4 import anchors_store
from tests.releases import content_snapshot
from tests.v41_trees import NIGHTLY_PACKAGE, RELEASE_PACKAGE, nightly_layout

#: (patch, V4.1 file relative to its package) -> verdict per release, as the code of each release earns it.
EXPECTED = {
    ("stream-load", "nvidia/vl_model.py"): ("pending", "pending", "pending", "upstream"),
    ("stream-load", "amd/vl_model.py"): ("pending", "pending", "pending", "upstream"),
    ("aux-streams", "nvidia/model.py"): ("pending", "pending", "pending", "pending"),
    ("wide-swa", "nvidia/flashinfer_sparse.py"): ("pending", "not-applicable", "not-applicable", "not-applicable"),
    ("dtype-policy", "nvidia/flashinfer_sparse.py"): ("upstream",) * 4,
    ("dtype-policy", "nvidia/flashmla.py"): ("upstream",) * 4,
}
VERSIONS = ("0.30.0", "0.31.0", "0.32.0", "0.33.0")


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

    applied = cli("apply", "--site-packages", tree, "--with", "aux-streams", "--json")
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
