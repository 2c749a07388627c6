"""Find the installed vLLM (and FlashInfer) from distribution metadata alone.

Nothing here imports vLLM, torch or FlashInfer: an environment without a GPU,
or with a broken torch, can still be judged and patched. Distributions are read
with :mod:`patch_dsv4.tree.installed`, the reader verify's fast path and the
serve guard use too: every damaged, oversized or odd metadata file (not UTF-8, a
RECORD field over the csv limit, a FIFO, missing) is a one-line error, never a
traceback, in bounded time and memory.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from patch_dsv4.output.errors import EnvironmentProblem
from patch_dsv4.tree import installed
from patch_dsv4.tree.fs import PackageTree, UnsafePath

VLLM = "vllm"
FLASHINFER = installed.FLASHINFER


record_digest = installed.record_digest  # the hash in pip's RECORD format: urlsafe base64 of sha256, no padding


@dataclass(frozen=True)
class Installed:
    """One installed distribution: its version, where it is, its RECORD and its requirements."""

    name: str
    version: str
    root: Path  # the directory the RECORD paths are relative to
    dist: installed.DistInfo = field(repr=False, compare=False)
    target: Target | None = field(default=None, repr=False, compare=False)  # how the user named its environment

    def reinstall(self, version: str | None = None) -> str:
        """The command that reinstalls this release where it is, as the user named the environment."""
        return _reinstall(self.name, version or self.version, self.target, self.root)

    @property
    def path(self) -> Path:
        """Its dist-info directory."""
        return Path(self.dist.path)

    def describe(self) -> str:
        return f"{self.name} {self.version} in {self.root}"

    def record(self) -> dict[str, str]:
        """RECORD as {relative path: urlsafe-base64 sha256}.

        A dist-info without a RECORD (or with one that is not a regular file) is an error: without it nothing
        tells pip's files from edited ones, so nothing is judged or written.
        """
        try:
            return self.dist.record()
        except installed.Unreadable as exc:
            if exc.why in ("is missing", "is not a regular file"):
                raise EnvironmentProblem(
                    f"{self.name} {self.version}'s RECORD {exc.why}",
                    "nothing tells pip's files from edited ones, so nothing is judged or written",
                    self.reinstall(),
                ) from None
            raise EnvironmentProblem(
                f"cannot read the RECORD of {self.describe()}", _short(exc), self.reinstall()
            ) from None

    def requires(self) -> list[str]:
        return self.dist.requires()


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 160 else text[:157] + "..."


def _reinstall(name: str, version: str | None, target: Target | None, root: Path | None) -> str:
    """pip's command that puts ``name`` (at ``version`` where it is known) back where it is installed."""
    requirement = f"{name}=={version}" if version else name
    if root is None:  # no directory known: the interpreter's own pip, as for the default target
        target = None
    return (target or Target(None)).pip(requirement, root or Path("."))


def _version_of_dist_info(path: str) -> str | None:
    """The version a dist-info's directory name gives (``vllm-0.30.0.dist-info``), where its METADATA cannot."""
    for part in reversed(Path(path).parts):
        if part.endswith(".dist-info"):
            name_version = part[: -len(".dist-info")].split("-")
            if len(name_version) == 2 and name_version[1][:1].isdigit():
                return name_version[1]
            return None
    return None


def find_distribution(
    name: str, search_path: Iterable[Path], package: str | None = None, target: Target | None = None
) -> Installed | None:
    """The first distribution called ``name`` on ``search_path`` (import order) (installed.find_dist).

    One directory can hold two dist-infos of one project (``pip install
    --target --upgrade`` leaves the old one behind): the one whose RECORD
    matches the files of ``package`` on disk is the installed one; when both
    match equally well, nothing tells them apart, and that is an error.
    """
    wanted = installed.canonical(name)
    search_path = list(search_path)
    try:
        found = installed.find_dist(wanted, search_path, package)
    except installed.Ambiguous as exc:
        raise EnvironmentProblem(
            str(exc),
            "nothing tells which release is installed",
            f"{_reinstall(wanted, None, target, search_path[0] if search_path else None)}, or remove the stale"
            " dist-info",
        ) from None
    except installed.Unreadable as exc:
        version = _version_of_dist_info(exc.path)
        dist_info = next((p for p in Path(exc.path).parents if p.name.endswith(".dist-info")), Path(exc.path))
        root = dist_info.parent
        if not dist_info.is_absolute():  # named relative to the directory of the search path that holds it
            root = next((Path(d) for d in search_path if (Path(d) / dist_info).exists()), None)
        raise EnvironmentProblem(
            f"cannot read a {wanted} METADATA", _short(exc), _reinstall(wanted, version, target, root)
        ) from None
    if found is None:
        return None
    return Installed(wanted, found.version, Path(found.root), found, target)


def flashinfer_pin(requirements: Iterable[str]) -> str | None:
    """The FlashInfer release a requirement list pins with ``flashinfer-python==X`` (no extra)."""
    return installed.flashinfer_pin(requirements)


@dataclass(frozen=True)
class Interpreter:
    """What another interpreter reports about itself (``--python EXE``)."""

    executable: str
    search_path: tuple[Path, ...]
    version: str | None = None
    machine: str | None = None


#: Run first in another interpreter, started with ``-S``: its site directories and ``.pth`` path lines as ``site``
#: adds them (a venv's, the user's, each .pth's directories), without running a start-up hook: no
#: ``sitecustomize``/``usercustomize`` import, no ``.pth`` line that begins with ``import`` (site.addpackage runs
#: those). patch-dsv4 reads hooks (tree.hooks), never runs them.
SAFE_SITE = """\
import os, site, sys
def _patch_dsv4_pth(sitedir, name, known_paths):
    reset = known_paths is None
    known = set() if reset else known_paths
    try:
        with open(os.path.join(sitedir, name), "rb") as fh:
            text = fh.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return None if reset else known
    for line in text.splitlines():
        if not line.strip() or line.startswith(("#", "import ", "import\t")):
            continue
        path, case = site.makepath(sitedir, line.rstrip())
        if case not in known and os.path.exists(path):
            sys.path.append(path)
            known.add(case)
    return None if reset else known
if sys.path and sys.path[0] == "":
    del sys.path[0]  # -c's working directory: site would make it absolute; the report leaves it out
site.addpackage = _patch_dsv4_pth
site.execsitecustomize = site.execusercustomize = lambda: None
site.main()
"""

_REPORT_CODE = SAFE_SITE + (
    "import json, platform\nprint(json.dumps({'path': [p for p in sys.path if p], "
    "'version': platform.python_version(), 'machine': platform.machine()}))\n"
)


def ask_interpreter(python: str) -> Interpreter:
    """Ask another interpreter for its sys.path, without importing anything of vLLM and without running its start-up
    hooks (``-S``, then :data:`SAFE_SITE`)."""
    advice = "pass --python a working Python interpreter"
    try:
        proc = subprocess.run(
            [python, "-S", "-c", _REPORT_CODE], capture_output=True, text=True, timeout=60, check=False
        )
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

    def import_path(self) -> tuple[list[str], list[str]]:
        """The directories the target interpreter imports from, in order, and those of them where ``.pth`` files
        run (None: its site-packages and dist-packages): the ``--site-packages`` directory alone, or the sys.path
        of ``--python``'s interpreter or of this one (patch_dsv4.tree.hooks reads its start-up hooks there)."""
        if self.target.option == "--site-packages":
            return [str(self.site_packages)], [str(self.site_packages)]
        if self.interpreter is not None:
            return [str(p) for p in self.interpreter.search_path], None
        return [p for p in sys.path if p], None

    def reinstall(self) -> str:
        return self.target.pip(f"vllm=={self.vllm_version}", self.site_packages)

    def reinstall_then(self, command: str = "apply") -> str:
        """The way out when only pip's own files will do: reinstall, then run ``command`` again."""
        return f"{self.reinstall()}, then patch-dsv4 {command}{self.target.args()}"


def _where_is_vllm(python: str | None) -> str:
    """The command that says where an interpreter has vLLM installed: the directory for --site-packages."""
    exe = _quote(python or sys.executable)
    return f"{exe} -m pip show vllm (its Location:, where vLLM is installed for that Python)"


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
                f"{site_packages} is not a directory",
                "--site-packages names the directory holding vllm/ and its dist-info",
                _where_is_vllm(None),
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
    vllm = find_distribution(VLLM, search, package="vllm", target=target)
    try:
        has_package = vllm is not None and (vllm.root / "vllm").is_dir()
    except OSError:
        has_package = False
    if vllm is None or not has_package:
        raise EnvironmentProblem(
            f"no vLLM in {where}",
            "no vllm-*.dist-info with a vllm/ package beside it",
            _where_is_vllm(python),
        )
    flashinfer = find_distribution(FLASHINFER, [vllm.root, *search], package="flashinfer", target=target)
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
