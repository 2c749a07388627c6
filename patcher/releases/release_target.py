"""A vLLM release to judge without installing or importing it: a wheel, or a source tree.

``drift`` and ``anchors record`` judge a release through the same
:class:`patch_dsv4.patching.patch.Context` as ``status``; only ``read_bytes`` differs. A
wheel is read member by member from the zip (only the files the patches ask
for are decompressed), a source tree file by file. The vLLM version and the
FlashInfer release it pins come from the dist-info METADATA, parsed by
:func:`patch_dsv4.tree.environment.flashinfer_pin`, as for an installed vLLM.
"""

from __future__ import annotations

import ast
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path

from packaging.utils import canonicalize_name

from patch_dsv4.output.errors import EnvironmentProblem
from patch_dsv4.patching.patch import Context
from patch_dsv4.releases import anchors_store
from patch_dsv4.tree.environment import find_distribution, flashinfer_pin, locate_vllm
from patch_dsv4.tree.fs import PackageTree, UnsafePath

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
def _fetch_instead(path: Path) -> str:
    """drift's way to a release's wheel without one at hand: --vllm-version, for the release the file's name gives,
    else the newest recorded one."""
    from patch_dsv4.releases.anchors_store import recorded_versions

    parts = path.name.split("-")
    named = parts[1] if len(parts) > 2 and parts[0] == "vllm" and parts[1][:1].isdigit() else None
    version = named or (recorded_versions() or ["0.34.0"])[-1]
    return f"patch-dsv4 drift --vllm-version {version} (pip fetches its wheel)"


def open_wheel(path: Path, flashinfer_version: str | None = None) -> ReleaseTarget:
    """A vLLM wheel, read lazily: the zip's directory now, each member when asked for."""
    if not path.exists():
        raise EnvironmentProblem(f"no such file: {path}", "", _fetch_instead(path))
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
