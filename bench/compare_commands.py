"""Every command's output and every manifest it leaves, dumped from one checkout, to compare two checkouts.

A refactoring that must keep behaviour byte-identical runs this on the commit before and after, and diffs the
two dumps. Each checkout runs in a child process of its own (its ``patch_dsv4`` first on ``sys.path``; the trees
and recipe builders come from this checkout's tests/, so both sides get the same inputs), over:

- the real release trees 0.28.0-0.33.0: status, apply --dry-run, apply, apply again, verify, takeover --dry-run,
  revert, revert again, each as a table and as --json;
- the recipes' trees (tests/recipe_trees.py: the DGX-Spark three with keep_going, lna's chain on 0.28.0): status,
  apply (refused), takeover --dry-run, takeover, verify, revert;
- forced cases: a hand edit outside our edits (apply refused, apply --dry-run --force, apply --force), a patched
  file edited after apply (verify, revert refused, revert --discard-local-edits), an opt-in (apply --with),
  journals recovery cannot finish and backups gone (status, apply, revert refused);
- V4.1 in the nightly layout (tests/v41_trees.py) on 0.30.0 and 0.33.0: status, apply --dry-run, apply, verify,
  takeover --dry-run, revert;
- MiaAI's kit (tests/miaai_trees.py): one script on 0.30.0 and 0.33.0 taken over from the release's wheel (apply
  --with refused, takeover --dry-run, takeover, verify, revert), the whole kit on 0.30.0, and on the nightly
  layout (takeover refused, apply). The wheels come from the tests' cache, and pip reaches no index;
- list (table, --json, --verbose), anchors record --all --check, drift --strict on every release (table, -v,
  --json), doctor on 0.30.0 and 0.34.0 with a small V4 MixedK pack and every V4.1 variant (table and --json).

Per step it records the exit status, stdout and stderr (the tree's path and temp dirs replaced by placeholders)
and the manifest as it stands after the step (sorted keys; its patch_digest, the hash of the checkout's own sources,
shown as a placeholder where it is that checkout's). Output: one JSON file.

    python bench/compare_commands.py --checkout DIR --out dump.json   # DIR: a checkout of the commit to dump
    python bench/compare_commands.py --diff before.json after.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TABLE_AND_JSON = ("", "--json")

CHILD = r"""
import atexit, io, json, os, re, shutil, sys, tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

package, root, out = sys.argv[1:4]
sys.path[:0] = [package, root]
import patch_dsv4
assert patch_dsv4.__file__.startswith(package), patch_dsv4.__file__
from patch_dsv4.cli import main
from patch_dsv4.fastpath.quick import patch_digest
from tests import miaai_trees as M
from tests.recipe_trees import run_chain
from tests.releases import RELEASES, cache_dir, copy_tree, hand_edit, pristine_tree, wheel
from tests.v41_trees import nightly_layout

os.environ["PATCH_DSV4_CACHE"] = str(cache_dir())  # takeover reads the release wheels the tests cached
os.environ["PIP_NO_INDEX"] = "1"

work = Path(tempfile.mkdtemp(prefix="compare-"))
atexit.register(shutil.rmtree, work, True)  # also when a step raises
steps = []
DSV4 = "vllm/models/deepseek_v4"
DIGEST = patch_digest()


def normalise(text, tree):
    text = text.replace(str(tree), "<TREE>").replace(str(work), "<WORK>")
    return re.sub(r"saved-edits/[^/\s'\"]+", "saved-edits/<RUN>", text)


def manifest(tree):
    path = tree / ".patch-dsv4" / "manifest.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("patch_digest") == DIGEST:  # the hash of the checkout's own sources differs by design
        data["patch_digest"] = "<this checkout's patch_digest()>"
    return normalise(json.dumps(data, sort_keys=True, indent=1), tree)


def run(case, tree, *args):
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        code = main([*args, "--site-packages", str(tree)])
    steps.append({
        "case": case,
        "args": " ".join(args),
        "code": code,
        "stdout": normalise(stdout.getvalue(), tree),
        "stderr": normalise(stderr.getvalue(), tree),
        "manifest": manifest(tree),
    })


def fresh(name, version):
    return copy_tree(pristine_tree(version), work / name / "site-packages")


def both(case, tree, *args):
    for extra in ("", "--json"):
        run(case, tree, *args, *([extra] if extra else []))


for version in RELEASES:
    case = f"release {version}"
    tree = fresh(case.replace(" ", "-"), version)
    both(case, tree, "status")
    both(case, tree, "apply", "--dry-run")
    run(case, tree, "apply")
    both(case, tree, "apply")
    both(case, tree, "verify")
    both(case, tree, "takeover", "--dry-run")
    run(case, tree, "revert")
    both(case, tree, "revert")
    both(case, tree, "takeover")
    run(case, tree, "revert", "--json")

DGX = ("stock028", "stream_load", "wide_swa")
recipes = {
    "dgx-spark 0.30.0": ("0.30.0", lambda t: run_chain(t, "0.30.0", DGX, keep_going=True)),
    "lna chain 0.28.0": ("0.28.0", lambda t: run_chain(t, "0.28.0", keep_going=True)),
    "wide_swa alone 0.33.0": ("0.33.0", lambda t: run_chain(t, "0.33.0", ("wide_swa",), keep_going=True)),
}
for case, (version, build) in recipes.items():
    tree = fresh(case.replace(" ", "-"), version)
    build(tree)
    both(case, tree, "status")
    both(case, tree, "apply")
    both(case, tree, "takeover", "--dry-run")
    run(case, tree, "takeover", "--json")
    both(case, tree, "verify")
    run(case, tree, "revert", "--json")
    both(case, tree, "status")

case = "forced 0.30.0"
tree = fresh("forced", "0.30.0")
vl = tree / DSV4 / "common" / "vl_model.py"
hand_edit(vl, vl.read_text() + "\n# a local hotfix\n")
both(case, tree, "apply")
run(case, tree, "apply", "--dry-run", "--force")
run(case, tree, "apply", "--force", "--json")
both(case, tree, "verify")
hand_edit(vl, vl.read_text() + "\n# edited after apply\n")
both(case, tree, "verify")
both(case, tree, "revert")
run(case, tree, "revert", "--discard-local-edits", "--json")
both(case, tree, "status")
run(case, tree, "apply", "--with", "aux-streams", "--json")
both(case, tree, "status")
run(case, tree, "revert")

case = "forced journal 0.30.0"  # a journal recovery cannot finish: the file changed since, or its copy is gone
tree = fresh("forced-journal", "0.30.0")
run(case, tree, "apply")
path = tree / ".patch-dsv4" / "manifest.json"
data = json.loads(path.read_text())
rel = sorted(data["files"])[0]
sha = data["files"][rel]
data["transaction"] = {"op": "apply", "files": {rel: {"from": "0" * 64, "to": "1" * 64}}}
path.write_text(json.dumps(data))
both(case, tree, "status")
both(case, tree, "apply")
both(case, tree, "revert")
data["transaction"] = {"op": "revert", "files": {rel: {"from": sha["after"], "to": "1" * 64}}}
path.write_text(json.dumps(data))
both(case, tree, "revert")
data["transaction"] = None
path.write_text(json.dumps(data))
shutil.rmtree(tree / ".patch-dsv4" / "backups")
both(case, tree, "revert")
run(case, tree, "revert", "--discard-local-edits")

for version in ("0.30.0", "0.33.0"):
    case = f"v41 nightly {version}"
    tree = nightly_layout(fresh(case.replace(" ", "-"), version))
    both(case, tree, "status")
    both(case, tree, "apply", "--dry-run")
    run(case, tree, "apply", "--json")
    both(case, tree, "verify")
    run(case, tree, "takeover", "--dry-run")
    both(case, tree, "revert")

kits = {
    "kit sm120 0.30.0": ("0.30.0", lambda t: M.apply_sm120_block64(t, "0.30.0")),
    "kit sm120 0.33.0": ("0.33.0", lambda t: M.apply_sm120_block64(t, "0.33.0")),
    "kit whole 0.30.0": ("0.30.0", lambda t: M.run_kit(t, "0.30.0")),
}
for case, (version, build) in kits.items():
    wheel("vllm", version)
    tree = fresh(case.replace(" ", "-"), version)
    build(tree)
    both(case, tree, "status")
    both(case, tree, "apply", "--with", "aux-streams")
    both(case, tree, "takeover", "--dry-run")
    run(case, tree, "takeover", "--json")
    both(case, tree, "verify")
    run(case, tree, "revert", "--json")
    both(case, tree, "status")

case = "kit nightly 0.30.0"
tree = nightly_layout(fresh("kit-nightly", "0.30.0"))
M.run_kit(tree, "0.30.0")
both(case, tree, "status")
both(case, tree, "apply", "--with", "exl3-wo-a-slices")
both(case, tree, "takeover")
run(case, tree, "apply", "--json")
both(case, tree, "verify")
run(case, tree, "revert", "--json")

def run_plain(case, *args):  # commands without a target tree
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        code = main(list(args))
    steps.append({
        "case": case,
        "args": " ".join(args),
        "code": code,
        "stdout": normalise(stdout.getvalue(), work),
        "stderr": normalise(stderr.getvalue(), work),
        "manifest": None,
    })


for extra in ("", "--json", "--verbose"):
    run_plain("list", "list", *([extra] if extra else []))
run_plain("anchors", "anchors", "record", "--all", "--check")
wheels = str(cache_dir() / "wheels")
for version in RELEASES:
    for extra in ("", "-v", "--json"):
        run_plain(f"drift {version}", "drift", "--vllm-version", version, "--strict", "--cache-dir", wheels,
                  *([extra] if extra else []))

from tests.doctor.synthetic import SMALL, build_mixedk_pack
from tests.doctor.synthetic_v41 import SMALL41, VARIANTS, build_v41_pack, build_v41_variant

packs = {"v4 mixedk": build_mixedk_pack(work / "pack-v4", SMALL)}
for name in VARIANTS:
    packs[f"v41 {name}"] = build_v41_variant(work / f"pack-v41-{name}", name, SMALL41)
for version in ("0.30.0", "0.34.0"):
    tree = fresh(f"doctor-{version}", version)
    for name, pack in packs.items():
        both(f"doctor {version} {name}", tree, "doctor", "--pack", str(pack))
Path(out).write_text(json.dumps(steps, indent=1))
print(f"{len(steps)} steps, {sum(s['manifest'] is not None for s in steps)} manifests")
"""


def package_of(checkout: Path, into: Path) -> Path:
    """The import package ``patch_dsv4`` laid out from a checkout's folders (pyproject's package-dir)."""
    pkg = into / "patch_dsv4"
    shutil.copytree(checkout / "patcher", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(checkout / "patches", pkg / "patches", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(checkout / "anchors", pkg / "anchors", ignore=shutil.ignore_patterns("__pycache__"))
    return into


def dump(checkout: Path, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        package = package_of(checkout, Path(tmp))
        subprocess.run([sys.executable, "-c", CHILD, str(package), str(ROOT), str(out)], check=True)


def diff(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    if len(a) != len(b):
        print(f"different step counts: {len(a)} vs {len(b)}")
        return 1
    differing = 0
    for x, y in zip(a, b, strict=True):
        for key in ("code", "stdout", "stderr", "manifest"):
            if x[key] != y[key]:
                differing += 1
                print(f"DIFFERS: {x['case']}: {x['args']}: {key}")
                break
    outputs = len(a) * 3
    manifests = sum(s["manifest"] is not None for s in a)
    print(f"{len(a)} steps compared ({outputs} outputs: exit status, stdout, stderr; {manifests} manifests): ", end="")
    print("identical" if not differing else f"{differing} differ")
    return 1 if differing else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--diff", nargs=2, type=Path)
    args = parser.parse_args()
    if args.diff:
        sys.exit(diff(*args.diff))
    if not (args.checkout and args.out):
        parser.error("pass --checkout DIR --out FILE, or --diff BEFORE AFTER")
    dump(args.checkout.resolve(), args.out.resolve())


if __name__ == "__main__":
    main()
