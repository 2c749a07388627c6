"""pip's bytes of installed vLLM files, taken from the release's own wheel.

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

import zipfile
from pathlib import Path

from packaging.version import InvalidVersion, Version

from patch_dsv4.environment import Environment, record_digest
from patch_dsv4.errors import EnvironmentProblem
from patch_dsv4.fs import MAX_SOURCE_BYTES


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
            from patch_dsv4.release_target import fetch_wheel

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
