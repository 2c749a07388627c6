"""Real vLLM and FlashInfer releases for the tests, fetched with pip into a cache.

Nothing of vLLM is committed: wheels are downloaded with pip (its configured
index) into ``$PATCH_DSV4_TEST_CACHE`` (default ``~/.cache/patch-dsv4-tests``),
installed once with ``pip install --no-deps --target`` into a pristine tree, and
each test works on a cheap copy of that tree (hard links for files we never
write, real copies for the DeepSeek-V4 sources and the dist-info).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

from patch_dsv4.tree.environment import record_digest

RELEASES = ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
PINNED_FLASHINFER = {
    "0.28.0": "0.6.16.post3",
    "0.29.0": "0.6.18",
    "0.30.0": "0.6.18.post1",
    "0.31.0": "0.7.0.post1",
    "0.32.0": "0.7.0.post1",
    "0.33.0": "0.7.2.post1",
    # not on the index: a test that installs a FlashInfer beside 0.34.0 takes one it serves (0.7.2.post1, left
    # from 0.33.0, or 0.7.4), as users do
    "0.34.0": "0.7.3",
}
DSV4 = "vllm/models/deepseek_v4"
# Copied for real into each test tree (everything else is hard-linked).
REAL_COPY = ("vllm/models", "vllm/v1/attention")


def cache_dir() -> Path:
    root = Path(os.environ.get("PATCH_DSV4_TEST_CACHE", Path.home() / ".cache" / "patch-dsv4-tests"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextmanager
def cache_lock(name: str):
    path = cache_dir() / f".{name}.lock"
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


REQUIRE_WHEELS = "PATCH_DSV4_REQUIRE_WHEELS"
#: pip's settings as the test session began. The cache is filled from the index they configure, whatever a test has
#: pointed pip at by then (a stand-in index, or none: that is the tool's pip, not the cache's); a test that asks how
#: an unfetchable wheel is said sets these instead.
PIP_SETTINGS = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
_unfetchable: dict[str, str] = {}  # what pip could not fetch in this process, with why: asked once


def pip_fetch(what: str, args: list[str]) -> None:
    """Run ``pip ARGS`` to fetch ``what`` from pip's configured index into the cache.

    When pip cannot (no index reachable, offline), the test that needed it skips, naming what and why;
    with ``PATCH_DSV4_REQUIRE_WHEELS=1`` (CI) it fails instead, so that nothing is skipped unseen.
    """
    if what not in _unfetchable:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | PIP_SETTINGS
        ran = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env)
        if ran.returncode == 0:
            return
        said = [line.strip() for line in (ran.stderr + ran.stdout).splitlines() if line.strip()]
        _unfetchable[what] = said[-1] if said else f"pip exited {ran.returncode}"
    reason = f"{what} is not in the test cache ({cache_dir()}) and pip could not fetch it: {_unfetchable[what]}"
    if os.environ.get(REQUIRE_WHEELS) == "1" or "PYTEST_CURRENT_TEST" not in os.environ:
        raise RuntimeError(reason)
    import pytest

    pytest.skip(f"{reason} (set {REQUIRE_WHEELS}=1 to fail instead)")


def wheel(project: str, version: str) -> Path:
    """The wheel of ``project==version``, downloaded once with pip."""
    directory = cache_dir() / "wheels"
    directory.mkdir(exist_ok=True)
    prefix = project.replace("-", "_")

    def find() -> Path | None:
        found = sorted(directory.glob(f"{prefix}-{version}-*.whl"))
        return found[0] if found else None

    if (hit := find()) is not None:
        return hit
    with cache_lock(f"wheel-{prefix}-{version}"):
        if (hit := find()) is not None:
            return hit
        pip_fetch(
            f"the {project} {version} wheel",
            ["download", "--quiet", "--no-deps", "-d", str(directory), f"{project}=={version}"],
        )
        hit = find()
        assert hit is not None, f"pip download gave no wheel for {project}=={version}"
        return hit


def pristine_tree(version: str) -> Path:
    """vLLM ``version`` installed with ``pip install --no-deps --target``; never written to."""
    target = cache_dir() / "trees" / f"vllm-{version}"
    if (target / ".complete").exists():
        return target
    whl = wheel("vllm", version)
    with cache_lock(f"tree-{version}"):
        if (target / ".complete").exists():
            return target
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-compile",
                "--disable-pip-version-check",
                "--target",
                str(partial),
                str(whl),
            ],
            check=True,
        )
        (partial / ".complete").write_text(version)
        partial.rename(target)
    return target


def copy_tree(source: Path, dest: Path) -> Path:
    """A cheap, writable copy of an installed tree.

    Real copies under REAL_COPY and the dist-info (where patches write and tests
    edit), hard links for the other files beside them, and symlinks for whole
    directories nothing writes to: about 300 entries instead of 5,600.
    """

    def on_the_way(rel: str) -> bool:
        return any(p == rel or p.startswith(rel + "/") for p in REAL_COPY)

    def inside(rel: str) -> bool:
        return any(rel == p or rel.startswith(p + "/") for p in REAL_COPY) or rel.split("/")[0].endswith(".dist-info")

    for root, dirs, files in os.walk(source):
        rel = Path(root).relative_to(source)
        rel_s = "" if str(rel) == "." else str(rel)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        keep = []
        for d in dirs:
            child = f"{rel_s}/{d}" if rel_s else d
            if inside(child) or on_the_way(child) or not rel_s:
                keep.append(d)
            else:
                os.symlink(Path(root) / d, dest / rel / d)
        dirs[:] = keep
        real = inside(rel_s) if rel_s else False
        for name in files:
            if name == ".complete":
                continue
            src, dst = Path(root) / name, dest / rel / name
            if real:
                shutil.copy2(src, dst)
            else:
                os.link(src, dst)
    return dest


def wheel_file(version: str, relpath: str) -> bytes:
    """A file's bytes exactly as the vLLM wheel ships it."""
    with zipfile.ZipFile(wheel("vllm", version)) as zf:
        return zf.read(relpath)


def install_flashinfer_sources(tree: Path, version: str) -> None:
    """The dist-info and the SM120 kernel sources of a FlashInfer wheel, laid out in ``tree`` as pip would."""
    with zipfile.ZipFile(wheel("flashinfer-python", version)) as zf:
        for name in zf.namelist():
            if ".dist-info/" in name or (name.startswith("flashinfer/data/csrc/") and "sparse_mla_sm120" in name):
                zf.extract(name, tree)


def rewrite_record(tree: Path, changed: list[str]) -> None:
    """Make the RECORD of a test copy match files the test rewrote (a re-released copy)."""
    (dist_info,) = tree.glob("vllm-*.dist-info")
    record = dist_info / "RECORD"
    lines = record.read_text().splitlines()
    changed_set = set(changed)
    out = []
    for line in lines:
        path = line.split(",", 1)[0]
        if path in changed_set:
            data = (tree / path).read_bytes()
            line = f"{path},sha256={record_digest(data)},{len(data)}"
        out.append(line)
    record.unlink()
    record.write_text("\n".join(out) + "\n")


def hand_edit(path: Path, text: str) -> None:
    """Change a file the way an editor would, without touching hard-linked siblings.

    Refuses a path through a symlinked directory: that is the shared pristine cache.
    """
    for parent in path.parents:
        assert not parent.is_symlink(), f"{path} lies under {parent}, a link into the shared cache"
    path.unlink()
    path.write_text(text)


def stat_snapshot(tree: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, size, mtime) of every file outside __pycache__: cheap, and any write shows."""
    snap = {}
    for root, dirs, files in os.walk(tree):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            p = Path(root) / name
            st = p.lstat()
            snap[str(p.relative_to(tree))] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return snap


def content_snapshot(tree: Path, under: str = DSV4) -> dict[str, str]:
    snap = {}
    base = tree / under
    for p in sorted(base.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            snap[str(p.relative_to(tree))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return snap


def minimal_tree(version: str, dest: Path) -> Path:
    """A real, self-contained install of ``version`` holding only what patch-dsv4 reads.

    The dist-info (RECORD untouched), the DeepSeek-V4 package and every file a
    judgement of this release reads (anchors/ lists them), extracted from the
    wheel as regular files: a tree another user can read in full.
    """
    from patch_dsv4.releases import anchors_store

    read = set(anchors_store.load(version)["files"])
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel("vllm", version)) as zf:
        for name in zf.namelist():
            if ".dist-info/" in name or name.startswith(DSV4 + "/") or name in read or name == "vllm/__init__.py":
                zf.extract(name, dest)
    return dest
