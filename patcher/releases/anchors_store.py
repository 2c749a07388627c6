"""The recorded anchors of known vLLM releases: ``anchors/vllm-<version>.json``.

Each file is written by ``patch-dsv4 anchors record`` from the release's real
wheel and holds, per patch, the verdict and the fingerprint of each anchor's
enclosing function, and the sha256 of every file the judgement read. They let
``drift`` tell a function it has seen (``recorded``) from one that changed
around a still-matching anchor (``new``), and let ``status`` tell a known
build from an unknown one (:func:`known_release`).

Only ``json`` and ``hashlib`` here: the fast paths that call
:func:`known_release` must not pay for libcst.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

# The package's file list lives with the fast paths, which must not import this module's dataclasses.
from patch_dsv4.fastpath.quick import PACKAGE_DIR, file_set_change, listed_package_files, package_files  # noqa: F401 - re-exported

SCHEMA_VERSION = 1
RECORD_COMMAND = "patch-dsv4 anchors record --all"


def anchors_dir() -> Path:
    """The anchors/ package data directory (the repository's own, in an editable install)."""
    from importlib.resources import files

    return Path(str(files("patch_dsv4.anchors")))


def anchors_path(vllm_version: str, directory: Path | None = None) -> Path:
    return (directory or anchors_dir()) / f"vllm-{vllm_version}.json"


def probes_path(vllm_version: str, directory: Path | None = None) -> Path:
    """Where a record's probe answers lie, beside it: only judging reads them, never verify's fast path or the
    guard (which read the record itself, kept as small as it was)."""
    return (directory or anchors_dir()) / f"vllm-{vllm_version}.probes.json"


def split(record: dict) -> tuple[dict, dict | None]:
    """(the record without its probe answers, the probe answers)."""
    main = {k: v for k, v in record.items() if k != "probes"}
    return main, record.get("probes")


def dumps(record: dict) -> str:
    """The one serialization of a record: sorted keys, so a fresh one compares byte for byte."""
    return json.dumps(record, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def load(vllm_version: str, directory: Path | None = None) -> dict | None:
    """The record of a release, its probe answers included (``probes``) where they are recorded."""
    try:
        record = json.loads(anchors_path(vllm_version, directory).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    try:
        record["probes"] = json.loads(probes_path(vllm_version, directory).read_text(encoding="utf-8"))
    except FileNotFoundError:
        pass
    return record


def recorded_versions(directory: Path | None = None) -> list[str]:
    """Every release with a record, in version order."""
    from packaging.version import InvalidVersion, Version

    found = [
        p.name[len("vllm-") : -len(".json")]
        for p in (directory or anchors_dir()).glob("vllm-*.json")
        if not p.name.endswith(".probes.json")
    ]

    def key(v: str):
        try:
            return (0, Version(v), "")
        except InvalidVersion:
            return (1, Version("0"), v)

    return sorted(found, key=key)


def load_all(directory: Path | None = None) -> dict[str, dict]:
    return {v: load(v, directory) for v in recorded_versions(directory)}


def known_fingerprints(records: Mapping[str, dict]) -> dict[tuple[str, str], dict[str, list[str]]]:
    """(file, scope) -> fingerprint -> the releases it was recorded for."""
    known: dict[tuple[str, str], dict[str, list[str]]] = {}
    for version, record in records.items():
        for patch in record.get("patches", {}).values():
            for anchor in patch.get("anchors", []):
                fp = anchor.get("fingerprint")
                if fp is None:
                    continue
                releases = known.setdefault((anchor["file"], anchor["scope"]), {}).setdefault(fp, [])
                if version not in releases:
                    releases.append(version)
    return known


@dataclass(frozen=True)
class BuildMatch:
    """Whether the files of a vLLM build are those recorded for its release.

    ``known`` is True only when anchors/ has a record for the release and every
    file it lists has the recorded sha256 (absent where it was absent).
    ``detail`` says which record matched, or why none did, in one line.
    """

    known: bool
    vllm_version: str
    detail: str
    mismatched: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.known


def known_release(
    vllm_version: str,
    file_hashes: Mapping[str, str | None] | Callable[[str], str | None],
    directory: Path | None = None,
    files: Iterable[str] | None = None,
    record: dict | None = None,
) -> BuildMatch:
    """Is this build of ``vllm_version`` the one recorded in anchors/?

    ``file_hashes`` gives the hex sha256 of a file of the tree by its relative
    path (``vllm/models/...``), None when the file is absent: a mapping, or a
    callable (e.g. ``lambda rel: sha256_path(env.path(rel))``), asked only for
    the files the record lists (:func:`recorded_files`). ``files`` are the
    Python files of the DeepSeek-V4 package in the tree (:func:`package_files`):
    one added or removed makes another build. ``record``: the record as read already (default: read here).
    """
    record = load(vllm_version, directory) if record is None else record
    if record is None:
        versions = recorded_versions(directory)
        span = f"{versions[0]}-{versions[-1]}" if versions else "none"
        return BuildMatch(
            False, vllm_version, f"unknown build: no anchors recorded for vLLM {vllm_version} (recorded: {span})"
        )
    change = file_set_change(record, files)
    if change is not None:
        return BuildMatch(False, vllm_version, f"unknown build of vLLM {vllm_version}: {change} in the model packages")
    lookup = file_hashes if callable(file_hashes) else file_hashes.get
    mismatched = tuple(rel for rel, sha in sorted(record["files"].items()) if lookup(rel) != sha)
    if mismatched:
        more = f" and {len(mismatched) - 1} more" if len(mismatched) > 1 else ""
        return BuildMatch(
            False,
            vllm_version,
            f"unknown build of vLLM {vllm_version}: {mismatched[0]}{more} differ(s) from the recorded release",
            mismatched,
        )
    return BuildMatch(
        True,
        vllm_version,
        f"known build: vLLM {vllm_version} matches anchors/vllm-{vllm_version}.json ({len(record['files'])} files)",
    )


def recorded_files(vllm_version: str, directory: Path | None = None) -> list[str]:
    """The files whose hashes :func:`known_release` compares for this release (empty when unrecorded)."""
    record = load(vllm_version, directory)
    return sorted(record["files"]) if record else []


def write(record: dict, directory: Path | None = None) -> Path:
    """Write a record atomically (temp file, fsync, rename), as every file patch-dsv4 writes."""
    import os

    from patch_dsv4.tree.fs import Dir, Owner

    path = anchors_path(record["vllm_version"], directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    main, probes = split(record)
    written = [(path, main)] + ([(probes_path(record["vllm_version"], directory), probes)] if probes else [])
    for target, data in written:
        mode = target.stat().st_mode & 0o7777 if target.exists() else 0o644
        with Dir.open(target.parent) as parent:
            parent.write_atomic(target.name, dumps(data).encode("utf-8"), Owner(os.geteuid(), os.getegid(), mode))
    return path
