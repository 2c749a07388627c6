"""What anchors/ records for each release: the one place the tests take per-release verdicts from.

``tests/engine/patching/test_verdicts.py`` checks every record against the real trees; the
other tests ask here which releases a patch is needed on, instead of keeping
tables of their own.
"""

from __future__ import annotations

from patch_dsv4.releases import anchors_store


def recorded_verdict(version: str, patch_id: str) -> str:
    return anchors_store.load(version)["patches"][patch_id]["verdict"]


def releases_needing(patch_id: str) -> list[str]:
    """The recorded releases on which ``patch_id`` is pending (with the FlashInfer each pins; opt-in patches too)."""
    return [v for v in anchors_store.recorded_versions() if recorded_verdict(v, patch_id) == "pending"]
