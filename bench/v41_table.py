"""The per-edit verdicts of every patch, V4 and V4.1, on the real releases in both V4.1 layouts.

For each release and layout (``release``: ``deepseek_v41/`` as the wheel ships
it; ``nightly``: the package renamed ``deepseek_v4_1/`` by tests/v41_trees.py),
on a fresh copy of the release tree: ``status --json``, ``apply --with
aux-streams --with exl3-wo-a-slices --json``, ``verify``, a second apply (must change nothing), then
``revert`` (every file of both model packages byte for byte as before).
Prints one row per patch and model: the verdicts of its edits before -> after.

    python bench/v41_table.py [--version 0.30.0 ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.releases import copy_tree, pristine_tree  # noqa: E402 - the checkout must be on sys.path first
from tests.v41_trees import nightly_layout  # noqa: E402

PACKAGES = ("vllm/models/deepseek_v4", "vllm/models/deepseek_v41", "vllm/models/deepseek_v4_1")


def cli(*args: str) -> tuple[int, dict | None]:
    done = subprocess.run([sys.executable, "-m", "patcher", *args], capture_output=True, text=True, cwd=ROOT)
    try:
        return done.returncode, json.loads(done.stdout)
    except json.JSONDecodeError:
        return done.returncode, None


def snapshot(tree: Path) -> dict[str, str]:
    return {
        str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
        for package in PACKAGES
        for p in sorted((tree / package).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def by_model(document: dict) -> dict[tuple[str, str], str]:
    """(patch, model) -> the verdicts of its edits where the model has code (not-applicable elsewhere)."""
    rows: dict[tuple[str, str], list[str]] = {}
    for patch in document["patches"]:
        for edit in patch["edits"]:
            model = "V4.1" if "/deepseek_v41/" in edit["file"] or "/deepseek_v4_1/" in edit["file"] else "V4"
            rows.setdefault((patch["id"], model), []).append(edit["verdict"])
    out = {}
    for key, verdicts in rows.items():
        live = [v for v in verdicts if v != "not-applicable"] or ["not-applicable"]
        out[key] = "/".join(dict.fromkeys(live))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="append", default=None)
    versions = parser.parse_args().version or ["0.30.0", "0.31.0", "0.32.0", "0.33.0"]
    print("| vLLM | layout | patch | model | before | after | verify | 2nd apply | revert |")
    print("|---|---|---|---|---|---|---|---|---|")
    failures = 0
    for version in versions:
        for layout in ("release", "nightly"):
            with tempfile.TemporaryDirectory() as tmp:
                tree = copy_tree(pristine_tree(version), Path(tmp) / "site-packages")
                if layout == "nightly":
                    nightly_layout(tree)
                site = ("--site-packages", str(tree))
                original = snapshot(tree)
                _, before = cli("status", *site, "--json")
                code, after = cli("apply", *site, "--with", "aux-streams", "--with", "exl3-wo-a-slices", "--json")
                verify, _ = cli("verify", *site, "--json")
                _, again = cli("apply", *site, "--json")
                reverted, _ = cli("revert", *site, "--json")
                same = snapshot(tree) == original
                second = "no change" if again and again["changed_files"] == [] else "CHANGED"
                failures += code != 0 or verify != 0 or second != "no change" or reverted != 0 or not same
                b, a = by_model(before), by_model(after)
                for key in sorted(b):
                    print(
                        f"| {version} | {layout} | {key[0]} | {key[1]} | {b[key]} | {a[key]} | "
                        f"{'ok' if verify == 0 else f'exit {verify}'} | {second} | "
                        f"{'byte for byte' if same and reverted == 0 else 'DIFFERS'} |"
                    )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
