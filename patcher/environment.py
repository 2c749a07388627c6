"""Find the installed vLLM (and FlashInfer) from distribution metadata alone.

Nothing here imports vLLM, torch or FlashInfer: an environment without a GPU,
or with a broken torch, can still be judged and patched.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from email.message import Message
from email.parser import HeaderParser
from pathlib import Path

from patcher.errors import EnvironmentProblem

_NAME_RE = re.compile(r"[-_.]+")


def canonical_name(name: str) -> str:
    return _NAME_RE.sub("-", name).lower()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record_digest(data: bytes) -> str:
    """The hash in pip's RECORD format: urlsafe base64 of sha256, no padding."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@dataclass(frozen=True)
class Distribution:
    name: str
    version: str
    dist_info: Path
    root: Path  # the directory the RECORD paths are relative to

    def metadata(self) -> Message:
        return HeaderParser().parsestr((self.dist_info / "METADATA").read_text(encoding="utf-8"))


def _read_dist(dist_info: Path) -> Distribution | None:
    meta = dist_info / "METADATA"
    try:
        headers = HeaderParser().parsestr(meta.read_text(encoding="utf-8"), headersonly=True)
    except OSError:
        return None
    name, version = headers.get("Name"), headers.get("Version")
    if not name or not version:
        return None
    return Distribution(canonical_name(name), version, dist_info, dist_info.parent)


def find_distribution(name: str, search_path: list[Path]) -> Distribution | None:
    """The first distribution called ``name`` on ``search_path`` (import order).

    One directory can hold two dist-infos of one project (``pip install
    --target --upgrade`` leaves the old one behind): the one whose RECORD
    matches the files on disk is the installed one.
    """
    wanted = canonical_name(name)
    for entry in search_path:
        if not entry.is_dir():
            continue
        found = []
        for dist_info in sorted(entry.glob("*.dist-info")):
            # "<name>-<version>.dist-info": versions hold no dash.
            if canonical_name(dist_info.name[: -len(".dist-info")].rpartition("-")[0]) != wanted:
                continue
            dist = _read_dist(dist_info)
            if dist is not None and dist.name == wanted:
                found.append(dist)
        if len(found) == 1:
            return found[0]
        if found:
            return max(found, key=_files_on_disk_matching)
    return None


def _files_on_disk_matching(dist: Distribution) -> int:
    """How many of the package's top-level modules on disk are the ones this RECORD lists."""
    try:
        record = read_record(dist)
    except EnvironmentProblem:
        return -1
    matches = 0
    for relpath, digest in record.items():
        if relpath.count("/") == 1 and relpath.endswith((".py",)) and not relpath.startswith("../"):
            try:
                matches += record_digest((dist.root / relpath).read_bytes()) == digest
            except OSError:
                pass
    return matches


@dataclass(frozen=True)
class Environment:
    """An environment holding vLLM, as far as patch-dsv4 is concerned."""

    site_packages: Path
    vllm: Distribution
    flashinfer_version: str | None
    flashinfer_source: str | None  # "installed" | "pinned" | None
    flashinfer_root: Path | None
    record: dict[str, str] = field(repr=False, compare=False)

    @property
    def vllm_version(self) -> str:
        return self.vllm.version

    @property
    def state_dir(self) -> Path:
        return self.site_packages / ".patch-dsv4"

    def path(self, relpath: str) -> Path:
        return self.site_packages / relpath

    def read(self, relpath: str) -> str | None:
        try:
            return self.path(relpath).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None

    def read_flashinfer(self, relpath: str) -> str | None:
        if self.flashinfer_root is None:
            return None
        try:
            return (self.flashinfer_root / relpath).read_text(encoding="utf-8")
        except (FileNotFoundError, UnicodeDecodeError):
            return None

    def recorded_hash(self, relpath: str) -> str | None:
        return self.record.get(relpath)


def read_record(dist: Distribution) -> dict[str, str]:
    try:
        text = (dist.dist_info / "RECORD").read_text(encoding="utf-8")
    except OSError as exc:
        raise EnvironmentProblem(
            f"cannot read {dist.dist_info / 'RECORD'}",
            str(exc.strerror or exc),
            f"reinstall vllm=={dist.version}",
        ) from None
    hashes: dict[str, str] = {}
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2 and row[1].startswith("sha256="):
            hashes[row[0]] = row[1][len("sha256=") :]
    return hashes


def pinned_flashinfer(dist: Distribution) -> str | None:
    """The FlashInfer release vLLM pins with ``flashinfer-python==X`` (no extra)."""
    for req in dist.metadata().get_all("Requires-Dist") or []:
        spec, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        m = re.fullmatch(r"\s*flashinfer[-_]python\s*\(?\s*==\s*([^\s,)]+)\s*\)?\s*", spec, re.I)
        if m:
            return m.group(1)
    return None


def interpreter_search_path(python: str) -> list[Path]:
    """Ask another interpreter for its sys.path, without importing anything of vLLM."""
    code = "import json, sys; print(json.dumps([p for p in sys.path if p]))"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EnvironmentProblem(f"cannot run {python}", str(exc), "pass --python a working interpreter") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EnvironmentProblem(f"{python} failed to report its sys.path", last, "pass --python a working interpreter")
    return [Path(p) for p in json.loads(proc.stdout)]


def locate_vllm(site_packages: Path | None = None, python: str | None = None) -> Environment:
    """Find vLLM in a directory, in another interpreter's environment, or in this one."""
    if site_packages is not None and python is not None:
        raise EnvironmentProblem("--site-packages and --python are exclusive", "", "pass one of them")
    if site_packages is not None:
        if not site_packages.is_dir():
            raise EnvironmentProblem(
                f"{site_packages} is not a directory", "", "point --site-packages at the directory holding vllm/"
            )
        search = [site_packages]
        where = str(site_packages)
    elif python is not None:
        search = interpreter_search_path(python)
        where = f"the environment of {python}"
    else:
        search = [Path(p) for p in sys.path if p]
        where = f"the environment of {sys.executable}"
    vllm = find_distribution("vllm", search)
    if vllm is None or not (vllm.root / "vllm").is_dir():
        raise EnvironmentProblem(
            f"no vLLM in {where}",
            "no vllm-*.dist-info with a vllm/ package beside it",
            "pip install vllm there, or pass --site-packages DIR / --python EXE",
        )
    flashinfer = find_distribution("flashinfer-python", [vllm.root, *search])
    if flashinfer is not None:
        fi_version, fi_source, fi_root = flashinfer.version, "installed", flashinfer.root
    else:
        fi_version = pinned_flashinfer(vllm)
        fi_source, fi_root = ("pinned" if fi_version else None), None
    return Environment(
        site_packages=vllm.root,
        vllm=vllm,
        flashinfer_version=fi_version,
        flashinfer_source=fi_source,
        flashinfer_root=fi_root,
        record=read_record(vllm),
    )
