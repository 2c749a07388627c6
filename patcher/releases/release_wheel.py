"""vLLM's release wheels: fetched by version into a cache, and pip's bytes of installed files read from them.

A release is fetched by version with pip (its configured index, plus any
options the user passes) into a cache of wheels: ``drift`` and ``anchors
record`` open the wheel (:func:`patch_dsv4.releases.release_target.open_wheel`), and a
take-over reads pip's bytes from it.

A take-over replaces each file another tool edited by what pip installed. The
recipes' scripts leave a backup beside the file that holds those bytes; kits
that keep no backup (MiaAI-Lab's overlay scripts) leave none. Then the bytes
come from the wheel of the installed release: fetched with pip (its configured
index, ``pip download --no-deps vllm==X``) into the wheel cache ``drift`` uses,
opened as a zip, and only the members needed are read, each checked against
the sha256 the environment's RECORD lists before anything is written. A build
whose wheel cannot be had (a local build such as ``0.1.dev20904+g179dd0fa9``,
a private image, no network) is said so in one line, and the take-over keeps
the reinstall advice.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from patch_dsv4.output.errors import EnvironmentProblem
from patch_dsv4.tree.environment import Environment, record_digest
from patch_dsv4.tree.fs import MAX_SOURCE_BYTES

VLLM = "vllm"


def unobtainable(version: str) -> str | None:
    """Why no index can serve the wheel of vLLM ``version`` (known without asking one), or None."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"vLLM {version!r} is not a release version"
    if parsed.local is not None:
        return f"vLLM {version} is a local build (+{parsed.local}): no index serves its wheel"
    return None


class ReleaseWheel:
    """The installed release's wheel, fetched once when first needed; ``problem`` says why it cannot serve."""

    def __init__(self, env: Environment, cache_dir: Path | None = None) -> None:
        self.env = env
        self.cache_dir = cache_dir
        self.path: Path | None = None
        self.problem: str | None = unobtainable(env.vllm_version)
        self._fetched = False

    def _wheel(self) -> Path | None:
        if self.problem is None and not self._fetched:
            self._fetched = True
            try:
                self.path, _how = fetch_wheel(self.env.vllm_version, self.cache_dir)
            except EnvironmentProblem as exc:
                self.problem = ": ".join(p for p in (exc.what, exc.why) if p)
        return self.path

    def pip_copy(self, relpath: str) -> tuple[str, bytes] | None:
        """(where the bytes come from, pip's bytes of ``relpath``) read from the wheel, or None (``problem`` says why).

        A member is returned only when its sha256 is the one the environment's RECORD lists for the file.
        """
        recorded = self.env.recorded_hash(relpath)
        if recorded is None:
            return None
        path = self._wheel()
        if path is None:
            return None
        try:
            with zipfile.ZipFile(path) as archive:
                info = archive.getinfo(relpath)
                if info.file_size > MAX_SOURCE_BYTES:
                    self.problem = f"{path.name}: {relpath} is larger than any source file"
                    return None
                data = archive.read(info)
        except KeyError:
            self.problem = f"{path.name} holds no {relpath}"
            return None
        except (OSError, zipfile.BadZipFile) as exc:
            self.problem = f"{path.name} cannot be read: {exc}"
            return None
        if record_digest(data) != recorded:
            self.problem = f"{path.name}: {relpath} is not what pip installed here (its sha256 differs from RECORD)"
            return None
        return f"the release wheel {path}", data


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


def flashinfer_pin_served(version: str, pip_options: Sequence[str] = ()) -> tuple[bool | None, str]:
    """Whether pip's configured index serves ``flashinfer-python==version`` (None: pip could not say), and a note.

    Asks ``pip index versions`` (tree.pip_index: the release list only, nothing downloaded); only drift
    --vllm-version, which fetches with pip anyway, calls it.
    """
    from patch_dsv4.tree.pip_index import index_versions

    extra = [arg for option in pip_options for arg in shlex.split(option)]
    served = index_versions("flashinfer-python", extra)
    if served is None:
        return None, f"FlashInfer {version}: pip's index could not be asked (pip index versions flashinfer-python)"
    try:
        wanted = Version(version)
        found = any(Version(v) == wanted for v in served if v)
    except InvalidVersion:
        found = version in served
    if found:
        return True, f"FlashInfer {version}, the pin, is on pip's index"
    near = ", ".join(served[:3])
    return False, f"FlashInfer {version}, the pin, is not on pip's index (it serves {near}, ...)"
