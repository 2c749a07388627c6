"""One patch alone (--only) through apply, apply again, verify and revert, with every assertion."""

from __future__ import annotations

from pathlib import Path

from tests.releases import content_snapshot, stat_snapshot, wheel_file


def roundtrip_one_patch(cli, tree: Path, patch_id: str, files: set[str], version: str, reformatted: bool) -> None:
    """Exactly ``files`` change; a second apply changes no byte; revert restores the wheel's bytes."""
    original = content_snapshot(tree)
    before = stat_snapshot(tree)

    applied = cli("apply", "--site-packages", tree, "--only", patch_id, "--json")
    assert applied.code == 0, applied.stderr
    assert applied.verdicts()[patch_id] == "applied"
    after = stat_snapshot(tree)
    changed = {f for f in after if before.get(f) != after[f] and not f.startswith(".patch-dsv4")}
    assert changed == set(applied.json()["changed_files"]) == files, "only the patch's own files change"

    snapshot, stats = content_snapshot(tree), stat_snapshot(tree)
    again = cli("apply", "--site-packages", tree, "--only", patch_id, "--json")
    assert again.code == 0, again.stderr
    assert again.json()["changed_files"] == []
    assert content_snapshot(tree) == snapshot and stat_snapshot(tree) == stats

    # (verify's exit status also answers for the patches left out by --only)
    verify = cli("verify", "--site-packages", tree, "--json")
    assert verify.verdicts()[patch_id] == "applied", verify.stdout

    reverted = cli("revert", "--site-packages", tree, "--json")
    assert reverted.code == 0, reverted.stderr
    assert content_snapshot(tree) == original
    if not reformatted:
        for relpath in files:
            assert (tree / relpath).read_bytes() == wheel_file(version, relpath)
    assert cli("status", "--site-packages", tree, "--json").verdicts()[patch_id] == "pending"
