"""Find the installed vLLM (and FlashInfer) from distribution metadata alone.

Nothing here imports vLLM, torch or FlashInfer: an environment without a GPU,
or with a broken torch, can still be judged and patched. Distributions are read
with :mod:`importlib.metadata`; every damaged metadata file (not UTF-8, a RECORD
field over the csv limit, missing) is a one-line error, never a traceback.
"""

from __future__ import annotations

import base64
import csv
import functools
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import Distribution, distributions
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from patch_dsv4.output.errors import EnvironmentProblem
from patch_dsv4.tree.fs import PackageTree, UnsafePath

VLLM = "vllm"
FLASHINFER = "flashinfer-python"


def record_digest(data: bytes) -> str:
    """The hash in pip's RECORD format: urlsafe base64 of sha256, no padding."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@dataclass(frozen=True)
class Installed:
    """One installed distribution: its version, where it is, its RECORD and its requirements."""

    name: str
    version: str
    root: Path  # the directory the RECORD paths are relative to
    dist: Distribution = field(repr=False, compare=False)

    def describe(self) -> str:
        return f"{self.name} {self.version} in {self.root}"

    def record(self) -> dict[str, str]:
        """RECORD as {relative path: urlsafe-base64 sha256}.

        A dist-info without a RECORD (or with one that is not a regular file) is an error: without it nothing
        tells pip's files from edited ones, so nothing is judged or written.
        """
        problem = _not_regular(self.dist, "RECORD")
        if problem:
            raise EnvironmentProblem(
                f"{self.name} {self.version}'s RECORD {problem}",
                "nothing tells pip's files from edited ones, so nothing is judged or written",
                f"reinstall {self.name}=={self.version}",
            )
        try:
            files = self.dist.files or []
            return {str(f): f.hash.value for f in files if f.hash is not None and f.hash.mode == "sha256"}
        except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
            raise EnvironmentProblem(
                f"cannot read the RECORD of {self.describe()}", _short(exc), f"reinstall {self.name}=={self.version}"
            ) from None

    def requires(self) -> list[str]:
        if _not_regular(self.dist, "METADATA"):
            return []
        try:
            return list(self.dist.requires or [])
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise EnvironmentProblem(
                f"cannot read the METADATA of {self.describe()}", _short(exc), f"reinstall {self.name}=={self.version}"
            ) from None


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 160 else text[:157] + "..."


def _not_regular(dist: Distribution, name: str) -> str | None:
    """Why a dist-info file cannot be read safely ("is missing", "is not a regular file"); None when it can.

    importlib.metadata opens files as they are: a FIFO there would block every process that looks.
    """
    import os
    import stat

    base = getattr(dist, "_path", None)  # PathDistribution's dist-info directory
    if base is None:
        return None
    try:
        st = os.stat(Path(str(base)) / name)
    except FileNotFoundError:
        return "is missing"
    except OSError as exc:
        return f"cannot be read ({_short(exc)})"
    return None if stat.S_ISREG(st.st_mode) else "is not a regular file"


def _read_installed(dist: Distribution, wanted: str) -> Installed | None:
    problem = _not_regular(dist, "METADATA")
    if problem == "is missing":
        return None
    if problem:
        raise EnvironmentProblem(f"cannot read a {wanted} METADATA", f"it {problem}", f"reinstall {wanted}")
    try:
        meta = dist.metadata
        name, version = meta["Name"], meta["Version"]
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EnvironmentProblem(f"cannot read a {wanted} METADATA", _short(exc), f"reinstall {wanted}") from None
    if not name or not version or canonicalize_name(name) != wanted:
        return None
    return Installed(wanted, version, Path(str(dist.locate_file(""))), dist)


def _matching_modules(found: Installed, package: str) -> int:
    """How many of the package's top-level modules on disk are the ones this RECORD lists."""
    try:
        record = found.record()
    except EnvironmentProblem:
        return -1
    matches = 0
    for relpath, digest in record.items():
        if relpath.startswith(package + "/") and relpath.count("/") == 1 and relpath.endswith(".py"):
            try:
                matches += record_digest((found.root / relpath).read_bytes()) == digest
            except OSError:
                pass
    return matches


def find_distribution(name: str, search_path: Iterable[Path], package: str | None = None) -> Installed | None:
    """The first distribution called ``name`` on ``search_path`` (import order).

    One directory can hold two dist-infos of one project (``pip install
    --target --upgrade`` leaves the old one behind): the one whose RECORD
    matches the files of ``package`` on disk is the installed one; when both
    match equally well, nothing tells them apart, and that is an error.
    """
    wanted = canonicalize_name(name)
    for entry in search_path:
        try:
            if not entry.is_dir():
                continue
        except OSError:
            continue
        found = [d for d in (_read_installed(x, wanted) for x in distributions(name=wanted, path=[str(entry)])) if d]
        if len(found) == 1:
            return found[0]
        if found:
            scored = sorted(((_matching_modules(d, package or wanted), d) for d in found), key=lambda x: -x[0])
            if scored[0][0] == scored[1][0]:
                both = " and ".join(d.version for _, d in scored[:2])
                raise EnvironmentProblem(
                    f"two {wanted} dist-infos in {entry} ({both}) match the files on disk equally well",
                    "nothing tells which release is installed",
                    f"reinstall {wanted} there (pip install --force-reinstall --no-deps), "
                    "or remove the stale dist-info",
                )
            return scored[0][1]
    return None


def flashinfer_pin(requirements: Iterable[str]) -> str | None:
    """The FlashInfer release a requirement list pins with ``flashinfer-python==X`` (no extra)."""
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != FLASHINFER:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        specs = list(req.specifier)
        if len(specs) == 1 and specs[0].operator == "==":
            return specs[0].version
    return None


@dataclass(frozen=True)
class Interpreter:
    """What another interpreter reports about itself (``--python EXE``)."""

    executable: str
    search_path: tuple[Path, ...]
    version: str | None = None
    machine: str | None = None


_REPORT_CODE = (
    "import json, platform, sys; print(json.dumps({'path': [p for p in sys.path if p], "
    "'version': platform.python_version(), 'machine': platform.machine()}))"
)


def ask_interpreter(python: str) -> Interpreter:
    """Ask another interpreter for its sys.path, without importing anything of vLLM."""
    advice = "pass --python a working Python interpreter"
    try:
        proc = subprocess.run([python, "-c", _REPORT_CODE], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        raise EnvironmentProblem(f"cannot run {python}", _short(exc), advice) from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EnvironmentProblem(f"{python} failed to report its sys.path", _short(last), advice)
    try:
        data = json.loads(proc.stdout)
        paths = tuple(Path(p) for p in data["path"] if isinstance(p, str))
        version, machine = data.get("version"), data.get("machine")
    except (ValueError, KeyError, TypeError):
        raise EnvironmentProblem(
            f"{python} is not a Python interpreter", "it did not report its sys.path", advice
        ) from None
    return Interpreter(
        python, paths, version if isinstance(version, str) else None, machine if isinstance(machine, str) else None
    )


@dataclass(frozen=True)
class Target:
    """How the user named the environment, so that advice names it the same way."""

    option: str | None  # "--site-packages" | "--python" | None (this interpreter)
    value: str | None = None

    def args(self) -> str:
        """The target option as it goes on a command line ('' for the default)."""
        return "" if self.option is None else f" {self.option} {_quote(self.value or '')}"

    def pip(self, requirement: str, site: Path) -> str:
        """The pip command that installs ``requirement`` into this environment."""
        if self.option == "--site-packages":
            return f"pip install --no-deps --force-reinstall --upgrade --target {_quote(str(site))} {requirement}"
        python = self.value if self.option == "--python" else sys.executable
        return f"{_quote(python or 'python')} -m pip install --no-deps --force-reinstall {requirement}"


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


@dataclass(frozen=True, eq=False)
class Environment:
    """An environment holding vLLM, as far as patch-dsv4 is concerned."""

    site_packages: Path
    vllm: Installed
    flashinfer_version: str | None
    flashinfer_source: str | None  # "installed" | "pinned" | None
    flashinfer_root: Path | None
    tree: PackageTree = field(repr=False, compare=False)
    target: Target = Target(None)
    interpreter: Interpreter | None = None

    @property
    def vllm_version(self) -> str:
        return self.vllm.version

    def read_bytes(self, relpath: str) -> bytes | None:
        """A file of the vLLM package, None when absent; OSError / UnsafePath when it cannot be read."""
        try:
            return self.tree.read(relpath)
        except FileNotFoundError:
            return None

    def sha256(self, relpath: str) -> str | None:
        return self.tree.sha256(relpath)

    def read_flashinfer(self, relpath: str) -> bytes | None:
        if self.flashinfer_root is None:
            return None
        try:
            with open(self.flashinfer_root / relpath, "rb") as fh:
                return fh.read(32 << 20)
        except OSError:
            return None

    @functools.cached_property
    def record(self) -> Mapping[str, str]:
        """pip's RECORD of vLLM (read when first asked for: a fast path never needs it)."""
        return self.vllm.record()

    def recorded_hash(self, relpath: str) -> str | None:
        return self.record.get(relpath)

    def reinstall(self) -> str:
        return self.target.pip(f"vllm=={self.vllm_version}", self.site_packages)

    def reinstall_then(self, command: str = "apply") -> str:
        """The way out when only pip's own files will do: reinstall, then run ``command`` again."""
        return f"{self.reinstall()}, then patch-dsv4 {command}{self.target.args()}"


def locate_vllm(site_packages: Path | None = None, python: str | None = None) -> Environment:
    """Find vLLM in a directory, in another interpreter's environment, or in this one."""
    interpreter = None
    if site_packages is not None and python is not None:
        raise EnvironmentProblem("--site-packages and --python are exclusive", "", "pass one of them")
    if site_packages is not None:
        try:
            is_dir = site_packages.is_dir()
        except OSError as exc:
            raise EnvironmentProblem(f"cannot use --site-packages {site_packages}", _short(exc)) from None
        if not is_dir:
            raise EnvironmentProblem(
                f"{site_packages} is not a directory", "", "point --site-packages at the directory holding vllm/"
            )
        search = [site_packages]
        where = str(site_packages)
        target = Target("--site-packages", str(site_packages))
    elif python is not None:
        interpreter = ask_interpreter(python)
        search = list(interpreter.search_path)
        where = f"the environment of {python}"
        target = Target("--python", python)
    else:
        search = [Path(p) for p in sys.path if p]
        where = f"the environment of {sys.executable}"
        target = Target(None)
    vllm = find_distribution(VLLM, search, package="vllm")
    try:
        has_package = vllm is not None and (vllm.root / "vllm").is_dir()
    except OSError:
        has_package = False
    if vllm is None or not has_package:
        raise EnvironmentProblem(
            f"no vLLM in {where}",
            "no vllm-*.dist-info with a vllm/ package beside it",
            "pip install vllm there, or pass --site-packages DIR / --python EXE",
        )
    flashinfer = find_distribution(FLASHINFER, [vllm.root, *search], package="flashinfer")
    if flashinfer is not None:
        fi_version, fi_source, fi_root = flashinfer.version, "installed", flashinfer.root
    else:
        fi_version = flashinfer_pin(vllm.requires())
        fi_source, fi_root = ("pinned" if fi_version else None), None
    try:
        tree = PackageTree(vllm.root)
    except UnsafePath as exc:
        raise EnvironmentProblem(f"cannot open the vllm/ package in {vllm.root}", exc.why or exc.what) from None
    return Environment(
        site_packages=vllm.root,
        vllm=vllm,
        flashinfer_version=fi_version,
        flashinfer_source=fi_source,
        flashinfer_root=fi_root,
        tree=tree,
        target=target,
        interpreter=interpreter,
    )
