"""Every patch's verdict on every recorded release, pristine and reformatted, against anchors/.

The per-release verdicts live in one place, ``anchors/vllm-*.json`` (checked
against fresh records of the real wheels in test_anchors.py): a new patch needs
no table of its own, and a change of verdict shows as a diff of that file.
"""

from __future__ import annotations

import pytest

from patch_dsv4.releases import anchors_store
from tests.conftest import RELEASE_PARAMS


@pytest.mark.parametrize("reformatted", [False, True], ids=["pristine", "reformatted"])
@pytest.mark.parametrize("version", RELEASE_PARAMS)
def test_status_gives_the_recorded_verdicts(version, reformatted, make_tree, cli):
    record = anchors_store.load(version)
    result = cli("status", "--site-packages", make_tree(version, reformatted=reformatted), "--json")
    assert result.code == 0, result.stderr
    assert set(result.verdicts()) == set(record["patches"]), "a patch without a record: re-record anchors/"
    for patch_id, recorded in record["patches"].items():
        patch = result.patch(patch_id)
        shown = "opt-in" if recorded["opt_in"] and recorded["verdict"] == "pending" else recorded["verdict"]
        assert patch["verdict"] == shown, (patch_id, patch["detail"])
        edits = [(e["file"], e["verdict"]) for e in patch["edits"]]
        assert edits == [(a["file"], a["verdict"]) for a in recorded["anchors"]], patch_id
