"""A vLLM release to judge without installing or importing it: a wheel, or a source tree.

``drift`` and ``anchors record`` judge a release through the same
:class:`patch_dsv4.patch.Context` as ``status``; only ``read_bytes`` differs. A
wheel is read member by member from the zip (only the files the patches ask
for are decompressed), a source tree file by file. The vLLM version and the
FlashInfer release it pins come from the dist-info METADATA, parsed by
:func:`patch_dsv4.environment.flashinfer_pin`, as for an installed vLLM.

Fetching a release by version goes through pip (its configured index, plus any
options the user passes), into a cache of wheels.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from patch_dsv4 import anchors_store
from patch_dsv4.environment import find_distribution, flashinfer_pin, locate_vllm
from patch_dsv4.errors import EnvironmentProblem
from patch_dsv4.fs import PackageTree, UnsafePath
from patch_dsv4.patch import Context

VLLM = "vllm"
# Where a vLLM source checkout pins FlashInfer (no dist-info to read there).
CHECKOUT_REQUIREMENTS = ("requirements/cuda.txt", "requirements/common.txt", "requirements-cuda.txt")
_PIN_RE = re.compile(r"^\s*flashinfer[-_]python\s*==\s*([^\s;#,]+)", re.I | re.M)


@dataclass
class ReleaseTarget:
    """One release to judge: where it comes from, its versions, and how to read its files."""

    description: str  # "wheel vllm-0.30.0-....whl", "source tree /src/vllm"
    vllm_version: str
    flashinfer_version: str | None
    flashinfer_source: str | None  # "installed" | "pinned" | None
    read_bytes: Callable[[str], bytes | None]
    read_flashinfer_bytes: Callable[[str], bytes | None] = lambda _relpath: None
    notes: list[str] = field(default_factory=list)  # what was chosen, and from where
    flashinfer_given: bool = False  # --flashinfer-version replaced the release's own
    flashinfer_pin_served: bool | None = None  # pip's index serves the pin (None: not asked)
    package_files: Callable[[], list[str]] = lambda: []  # the DeepSeek-V4 package's Python files
    _close: Callable[[], None] = lambda: None

    def context(self) -> Context:
        return Context(
            vllm_version=self.vllm_version,
            flashinfer_version=self.flashinfer_version,
            flashinfer_source=self.flashinfer_source,
            read_bytes=self.read_bytes,
            read_flashinfer_bytes=self.read_flashinfer_bytes,
            flashinfer_given=self.flashinfer_given,
            flashinfer_pin_served=self.flashinfer_pin_served,
        )

    def close(self) -> None:
        self._close()

    def __enter__(self) -> ReleaseTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _override_flashinfer(target: ReleaseTarget, flashinfer_version: str | None) -> ReleaseTarget:
    if flashinfer_version is None:
        return target
    was = target.flashinfer_version or "none"
    target.notes.append(f"FlashInfer {flashinfer_version} from --flashinfer-version (the release's own: {was})")
    target.flashinfer_version = flashinfer_version
    # Judged by its release number, as a pinned FlashInfer is (patches know "installed" and "pinned").
    target.flashinfer_source = "pinned"
    target.flashinfer_given = True
    target.read_flashinfer_bytes = lambda _relpath: None
    return target


# -- wheels ------------------------------------------------------------------------
def open_wheel(path: Path, flashinfer_version: str | None = None) -> ReleaseTarget:
    """A vLLM wheel, read lazily: the zip's directory now, each member when asked for."""
    if not path.exists():
        raise EnvironmentProblem(f"no such file: {path}", "", "pass the path of a vLLM wheel (.whl)")
    if path.is_dir():
        raise EnvironmentProblem(f"{path} is a directory, not a wheel", "", f"patch-dsv4 drift --source {path}")
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise EnvironmentProblem(
            f"{path} is not a wheel", f"not a zip archive ({exc})", "pass a vLLM .whl file, e.g. from pip download"
        ) from None
    try:
        target = _wheel_target(path, archive)
    except BaseException:
        archive.close()
        raise
    return _override_flashinfer(target, flashinfer_version)


def _wheel_target(path: Path, archive: zipfile.ZipFile) -> ReleaseTarget:
    names = archive.namelist()
    metadata = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
    if len(metadata) != 1:
        why = "no *.dist-info/METADATA in it" if not metadata else "several *.dist-info/METADATA in it"
        raise EnvironmentProblem(f"{path} is not a wheel", why, "pass a vLLM .whl file, e.g. from pip download")
    message = HeaderParser().parsestr(archive.read(metadata[0]).decode("utf-8", "replace"))
    name, version = message.get("Name"), message.get("Version")
    if not name or not version:
        raise EnvironmentProblem(f"{path} is not a wheel", f"{metadata[0]} has no Name or Version", "")
    if canonicalize_name(name) != VLLM:
        raise EnvironmentProblem(f"{path} is a wheel of {name} {version}, not of vLLM", "", "pass a vllm-*.whl file")
    # Root-is-purelib wheels keep vllm/ at the top; others under <name>.data/{purelib,platlib}/.
    members = {n: n for n in names}
    for n in names:
        m = re.match(r"[^/]+\.data/(?:purelib|platlib)/(.+)", n)
        if m:
            members.setdefault(m.group(1), n)
    if not any(n.startswith("vllm/") for n in members):
        raise EnvironmentProblem(f"{path} is not a vLLM wheel", "it holds no vllm/ package", "")

    def read_bytes(relpath: str) -> bytes | None:
        member = members.get(relpath)
        return None if member is None else archive.read(member)

    pinned = flashinfer_pin(message.get_all("Requires-Dist") or [])
    notes = [
        f"vLLM {version} from {metadata[0]} in {path.name}",
        f"FlashInfer {pinned} pinned by {metadata[0]}" if pinned else f"{metadata[0]} pins no FlashInfer",
    ]
    return ReleaseTarget(
        description=f"wheel {path.name}",
        vllm_version=version,
        flashinfer_version=pinned,
        flashinfer_source="pinned" if pinned else None,
        read_bytes=read_bytes,
        notes=notes,
        package_files=lambda: anchors_store.package_files(members),
        _close=archive.close,
    )


# -- source trees -------------------------------------------------------------------
def _version_file(root: Path) -> str | None:
    """``__version__`` as vllm/_version.py (written by the build's VCS versioning) sets it."""
    try:
        tree = ast.parse((root / "vllm" / "_version.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            if any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets):
                return node.value.value
    return None


def _checkout_pin(root: Path) -> tuple[str, str] | None:
    for relpath in CHECKOUT_REQUIREMENTS:
        try:
            text = (root / relpath).read_text(encoding="utf-8")
        except OSError:
            continue
        m = _PIN_RE.search(text)
        if m:
            return m.group(1), relpath
    return None


def open_source(root: Path, vllm_version: str | None = None, flashinfer_version: str | None = None) -> ReleaseTarget:
    """A directory with vllm/ under it: an installed tree (with its dist-info) or a checkout."""
    if not root.exists():
        raise EnvironmentProblem(f"no such directory: {root}", "", "pass --source a directory holding vllm/")
    if not root.is_dir():
        raise EnvironmentProblem(
            f"{root} is not a directory", "", "pass --source a directory holding vllm/, or --wheel FILE"
        )
    if not (root / "vllm" / "__init__.py").is_file():
        raise EnvironmentProblem(
            f"no vllm/ package under {root}", "no vllm/__init__.py there", "pass the directory that holds vllm/"
        )

    try:
        tree = PackageTree(root)
    except UnsafePath as exc:
        raise EnvironmentProblem(f"cannot open {root / 'vllm'}", exc.why or exc.what) from None

    def read_bytes(relpath: str) -> bytes | None:
        try:
            return tree.read(relpath)
        except (FileNotFoundError, NotADirectoryError):
            return None

    notes: list[str] = []
    dist = find_distribution(VLLM, [root], package="vllm")
    if dist is not None:
        # An installed tree: FlashInfer exactly as status sees it (installed beside vLLM, else pinned).
        env = locate_vllm(site_packages=root)
        version, fi_version, fi_source = env.vllm_version, env.flashinfer_version, env.flashinfer_source
        read_flashinfer = env.read_flashinfer
        where = f"the vllm {dist.version} dist-info"
        if vllm_version is not None and vllm_version != version:
            notes.append(f"vLLM {vllm_version} from --vllm-version ({where} says {version})")
            version = vllm_version
        else:
            notes.append(f"vLLM {version} from {where}")
        if fi_source == "installed":
            notes.append(f"FlashInfer {fi_version} installed in {root}")
        elif fi_version:
            notes.append(f"FlashInfer {fi_version} pinned by {where}")
    else:
        read_flashinfer = lambda _relpath: None  # noqa: E731 - the other branch binds a method here
        from_file = _version_file(root)
        if vllm_version is not None:
            version = vllm_version
            notes.append(f"vLLM {version} from --vllm-version")
        elif from_file is not None:
            version = from_file
            notes.append(f"vLLM {version} from vllm/_version.py (no vllm dist-info in {root})")
        else:
            raise EnvironmentProblem(
                f"cannot tell the vLLM version of {root}",
                "no vllm-*.dist-info and no vllm/_version.py there",
                f"patch-dsv4 drift --source {root} --vllm-version X",
            )
        pin = _checkout_pin(root)
        fi_version, fi_source = (pin[0], "pinned") if pin else (None, None)
        notes.append(f"FlashInfer {pin[0]} pinned by {pin[1]}" if pin else "no FlashInfer pin found in the checkout")
    target = ReleaseTarget(
        description=f"source tree {root}",
        vllm_version=version,
        flashinfer_version=fi_version,
        flashinfer_source=fi_source,
        read_bytes=read_bytes,
        read_flashinfer_bytes=read_flashinfer,
        notes=notes,
        package_files=lambda: anchors_store.listed_package_files(root),
    )
    return _override_flashinfer(target, flashinfer_version)


# -- fetching ------------------------------------------------------------------------
def default_cache_dir() -> Path:
    base = os.environ.get("PATCH_DSV4_CACHE")
    if base:
        return Path(base) / "wheels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "patch-dsv4" / "wheels"


def cached_wheel(version: str, cache_dir: Path) -> Path | None:
    """A vllm wheel of exactly ``version`` already in the cache (first by name)."""
    wanted = Version(version)
    for candidate in sorted(cache_dir.glob("vllm-*.whl")):
        try:
            name, found, _build, _tags = parse_wheel_filename(candidate.name)
        except (InvalidWheelFilename, InvalidVersion):
            continue
        if name == VLLM and found == wanted:
            return candidate
    return None


def fetch_wheel(
    version: str,
    cache_dir: Path | None = None,
    pip_options: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
) -> tuple[Path, str]:
    """The wheel of vllm==version: from the cache, else downloaded with pip into it. Returns (path, how).

    A download shows pip's own progress when stderr is a terminal, and a line
    before and after it (what, how big) otherwise.
    """
    try:
        Version(version)
    except InvalidVersion:
        raise EnvironmentProblem(
            f"{version!r} is not a valid vLLM version", "expected a PEP 440 version such as 0.30.0", ""
        ) from None
    cache_dir = cache_dir or default_cache_dir()
    hit = cached_wheel(version, cache_dir) if cache_dir.is_dir() else None
    if hit is not None:
        return hit, f"cached in {cache_dir}"
    cache_dir.mkdir(parents=True, exist_ok=True)
    extra = [arg for option in pip_options for arg in shlex.split(option)]
    on_terminal = sys.stderr.isatty()
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        *([] if on_terminal else ["--quiet"]),
        "--dest",
        str(cache_dir),
        *extra,
        f"vllm=={version}",
    ]
    if progress is not None:
        progress(f"fetching vllm=={version} with pip into {cache_dir} (a vLLM wheel is about 300 MB)")
    started = time.monotonic()
    try:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot run pip to fetch vllm=={version}", str(exc), "pass --wheel FILE") from None
    tail = _pass_through(proc.stderr, sys.stderr if on_terminal else None)
    if proc.wait() != 0:
        lines = tail.decode("utf-8", "replace").splitlines()
        errors = [line for line in lines if line.startswith("ERROR:")]
        last = (errors or [line for line in lines if line.strip()] or ["pip failed without a message"])[-1]
        raise EnvironmentProblem(
            f"cannot fetch vllm=={version} with pip",
            last.removeprefix("ERROR: ").strip(),
            "check the version (pip index versions vllm), or pass --wheel FILE",
        )
    hit = cached_wheel(version, cache_dir)
    if hit is None:
        raise EnvironmentProblem(
            f"pip download gave no wheel of vllm=={version}", f"nothing matching in {cache_dir}", "pass --wheel FILE"
        )
    if progress is not None:
        progress(f"fetched {hit.name} ({hit.stat().st_size / 1e6:.0f} MB) in {time.monotonic() - started:.0f} s")
    return hit, f"downloaded with pip into {cache_dir}"


def flashinfer_pin_served(version: str, pip_options: Sequence[str] = ()) -> tuple[bool | None, str]:
    """Whether pip's configured index serves ``flashinfer-python==version`` (None: pip could not say), and a note.

    Asks ``pip index versions`` (the release list only, nothing downloaded); only drift --vllm-version, which
    fetches with pip anyway, calls it.
    """
    extra = [arg for option in pip_options for arg in shlex.split(option)]
    command = [sys.executable, "-m", "pip", "index", "versions", "flashinfer-python", "--disable-pip-version-check"]
    try:
        proc = subprocess.run([*command, *extra], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"FlashInfer {version}: pip's index could not be asked ({exc})"
    listed = next((line for line in proc.stdout.splitlines() if line.startswith("Available versions:")), None)
    if proc.returncode != 0 or listed is None:
        return None, f"FlashInfer {version}: pip's index could not be asked (pip index versions flashinfer-python)"
    served = [v.strip() for v in listed.split(":", 1)[1].split(",")]
    try:
        wanted = Version(version)
        found = any(Version(v) == wanted for v in served if v)
    except InvalidVersion:
        found = version in served
    if found:
        return True, f"FlashInfer {version}, the pin, is on pip's index"
    near = ", ".join(served[:3])
    return False, f"FlashInfer {version}, the pin, is not on pip's index (it serves {near}, ...)"


def _pass_through(source, terminal) -> bytes:
    """Copy pip's stderr to the terminal as it comes (its progress bar), keeping the last part for errors."""
    kept = b""
    while True:
        chunk = os.read(source.fileno(), 4096)
        if not chunk:
            return kept
        if terminal is not None:
            terminal.buffer.write(chunk) if hasattr(terminal, "buffer") else terminal.write(
                chunk.decode("utf-8", "replace")
            )
            terminal.flush()
        kept = (kept + chunk)[-8192:]
