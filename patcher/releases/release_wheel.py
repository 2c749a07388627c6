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
import shutil
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
    """The installed release's wheel, fetched once when first needed; ``problem`` says why it cannot serve.

    ``fetch=False``: only a wheel already in the cache serves (a command that reports, and fetches nothing);
    ``uncached`` then says that one that fetches would have tried pip.
    """

    def __init__(self, env: Environment, cache_dir: Path | None = None, fetch: bool = True) -> None:
        self.env = env
        self.cache_dir = cache_dir
        self.fetch = fetch
        self.path: Path | None = None
        self.problem: str | None = unobtainable(env.vllm_version)
        self.uncached = False
        self._fetched = False

    def _wheel(self) -> Path | None:
        if self.problem is None and not self._fetched:
            self._fetched = True
            if not self.fetch:
                cache = self.cache_dir or default_cache_dir()
                self.path = cached_wheel(self.env.vllm_version, cache) if cache.is_dir() else None
                if self.path is None:
                    self.uncached = True
                    self.problem = f"the vllm=={self.env.vllm_version} wheel is not in {cache}"
                return self.path
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
    bars=None,
) -> tuple[Path, str]:
    """The wheel of vllm==version: from the cache, else downloaded with pip into it. Returns (path, how).

    ``progress`` gets a line before and after a download; ``bars`` (:func:`patch_dsv4.output.progress.progress`)
    shows its bytes, total and rate while it runs, where a terminal shows them.
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
    shown = bars is not None and bars.shown
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        *([] if shown else ["--quiet"]),
        "--dest",
        str(cache_dir),
        *extra,
        f"vllm=={version}",
    ]
    if progress is not None:
        progress(f"fetching vllm=={version} with pip into {cache_dir} (a vLLM wheel is about 300 MB)")
    started = time.monotonic()
    code, tail = _run_pip(command, bars if shown else None, f"vllm=={version}")
    if code != 0:
        lines = tail.decode("utf-8", "replace").splitlines()
        errors = [line for line in lines if line.startswith("ERROR:")]
        last = (errors or [line for line in lines if line.strip()] or ["pip failed without a message"])[-1]
        raise EnvironmentProblem(
            f"cannot fetch vllm=={version} with pip",
            last.removeprefix("ERROR: ").strip(),
            f"{sys.executable} -m pip index versions vllm (the releases pip's index serves), or pass --wheel FILE",
        )
    hit = cached_wheel(version, cache_dir)
    if hit is None:
        raise EnvironmentProblem(
            f"pip download gave no wheel of vllm=={version}", f"nothing matching in {cache_dir}", "pass --wheel FILE"
        )
    if progress is not None:
        progress(f"fetched {hit.name} ({hit.stat().st_size / 1e6:.0f} MB) in {time.monotonic() - started:.0f} s")
    return hit, f"downloaded with pip into {cache_dir}"


def _run_pip(command: list[str], bars, what: str) -> tuple[int, bytes]:
    """Run pip; (its exit status, the last part of its stderr). With ``bars``, pip's download is shown as it grows:
    pip downloads into a temporary directory of its own (given here, through TMPDIR) before it copies the wheel to
    --dest, and says the wheel's size on stdout ("Downloading NAME (240.5 MB)")."""
    import tempfile
    import threading

    scratch = tempfile.mkdtemp(prefix="patch-dsv4-pip-") if bars is not None else None
    env = {**os.environ, "TMPDIR": scratch} if scratch else None
    try:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE if bars is not None else subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
        )
    except OSError as exc:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        raise EnvironmentProblem(f"cannot run pip to fetch {what}", str(exc), "pass --wheel FILE") from None
    kept: list[bytes] = [b""]
    total: list[float | None] = [None]
    readers = [threading.Thread(target=_keep_tail, args=(proc.stderr, kept), daemon=True)]
    if bars is not None:
        readers.append(threading.Thread(target=_find_size, args=(proc.stdout, total), daemon=True))
    for reader in readers:
        reader.start()
    try:
        if bars is not None:
            task, seen = bars.task(what, None, download=True), 0
            while proc.poll() is None:
                seen = max(seen, _largest_under(scratch))  # pip moves the file out when it is whole
                bars.update(task, completed=seen, total=total[0])
                time.sleep(0.1)
            bars.done(task)
        code = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: pip goes too
            proc.kill()
            proc.wait()
        for reader in readers:
            reader.join(timeout=5)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return code, kept[0]


def _keep_tail(source, kept: list[bytes]) -> None:
    while chunk := source.read1(4096) if hasattr(source, "read1") else source.read(4096):
        kept[0] = (kept[0] + chunk)[-8192:]


_UNITS = {"kB": 1e3, "MB": 1e6, "GB": 1e9, "bytes": 1.0}


def _find_size(source, total: list[float | None]) -> None:
    """The size pip announces for the file it downloads (``Downloading NAME (240.5 MB)``), into ``total[0]``."""
    for raw in source:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("Downloading ") and line.endswith(")") and " (" in line:
            number, _, unit = line.rsplit(" (", 1)[1][:-1].partition(" ")
            try:
                total[0] = float(number) * _UNITS[unit]
            except (ValueError, KeyError):
                pass


def _largest_under(directory: str) -> int:
    """The bytes of the largest file under ``directory``: pip's partial download in its temporary directory. Not
    their sum: over https pip's HTTP cache writes each body twice there (its own temporary copy beside
    ``pip-unpack-*/NAME.whl``), and one ``--no-deps`` fetch is one file."""
    found = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                found = max(found, os.lstat(os.path.join(root, name)).st_size)
            except OSError:
                pass
    return found


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
