"""What patch-dsv4 keeps in the target environment, and how it writes files.

Layout, inside the site-packages directory that holds vllm/:

    .patch-dsv4.lock              one lock per environment (removed by revert)
    .patch-dsv4/manifest.json     the Manifest (schema-versioned JSON)
    .patch-dsv4/backups/<path>    each patched file as it was before we wrote it
    .patch-dsv4/staged/<path>     new contents, only while an apply is in flight

Every file is written as temp file + fsync + os.replace, so a reader (or a
killed writer) only ever sees the old or the new bytes. A multi-file change is
journalled in the manifest before the first target file is replaced; the next
run rolls it forward (apply) or finishes it (revert).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from patcher.errors import EnvironmentProblem

SCHEMA_VERSION = 1
STATE_DIR = ".patch-dsv4"
LOCK_FILE = ".patch-dsv4.lock"

# Tests set this to a callable(step_name) to simulate a crash between steps.
_fault_hook = None


def _step(name: str) -> None:
    if _fault_hook is not None:
        _fault_hook(name)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_path(path: Path) -> str | None:
    try:
        return sha256_bytes(path.read_bytes())
    except FileNotFoundError:
        return None


# -- atomic file operations ---------------------------------------------------
def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path, tag: str) -> Path:
    return path.with_name(f".{path.name}.patch-dsv4-{tag}.tmp")


def remove_temp_files(path: Path) -> None:
    """Remove what a killed atomic_write of ``path`` may have left beside it."""
    for tmp in path.parent.glob(_temp_name(path, "*").name):
        tmp.unlink(missing_ok=True)


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace ``path`` with ``data``: readers see the old or the new file, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path, str(os.getpid()))
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            _step(f"write:{path.name}")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        _step(f"replace:{path.name}")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def remove_bytecode(source: Path) -> None:
    """Remove every cached .pyc of ``source``: an unchecked-hash .pyc is never revalidated."""
    stem = source.stem
    cache = source.parent / "__pycache__"
    if cache.is_dir():
        for pyc in cache.glob(f"{stem}.*.pyc"):
            if pyc.name.split(".")[0] == stem:
                pyc.unlink(missing_ok=True)
    source.with_suffix(".pyc").unlink(missing_ok=True)


def replace_source(path: Path, data: bytes) -> None:
    remove_bytecode(path)
    atomic_write(path, data)
    remove_bytecode(path)


# -- the manifest ---------------------------------------------------------------
@dataclass
class FileEntry:
    before: str  # sha256 of the file as installed (what the backup holds)
    after: str  # sha256 of the file as we wrote it
    patches: list[str]


@dataclass
class Manifest:
    vllm_version: str
    tool_version: str
    files: dict[str, FileEntry] = field(default_factory=dict)
    # The judgement the last write was based on, for verify's fast path:
    # per patch id its verdict, and the sha256 of every file that judgement read.
    verdicts: dict[str, dict] = field(default_factory=dict)
    inputs: dict[str, str | None] = field(default_factory=dict)
    flashinfer: dict[str, str | None] = field(default_factory=dict)
    transaction: dict | None = None
    schema: int = SCHEMA_VERSION

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: Path) -> "Manifest":
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            if data.get("schema") != SCHEMA_VERSION:
                raise ValueError(f"schema {data.get('schema')!r}, this tool reads {SCHEMA_VERSION}")
            files = {k: FileEntry(**v) for k, v in data["files"].items()}
            return cls(
                vllm_version=str(data["vllm_version"]),
                tool_version=str(data["tool_version"]),
                files=files,
                verdicts=dict(data.get("verdicts", {})),
                inputs=dict(data.get("inputs", {})),
                flashinfer=dict(data.get("flashinfer", {})),
                transaction=data.get("transaction"),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise EnvironmentProblem(
                f"unreadable state {where}",
                f"{exc}",
                f"inspect it; if vLLM is pristine, remove {where.parent} and run patch-dsv4 status",
            ) from None


class StateStore:
    """The state directory of one environment."""

    def __init__(self, site_packages: Path) -> None:
        self.root = site_packages
        self.dir = site_packages / STATE_DIR
        self.manifest_path = self.dir / "manifest.json"
        self.lock_path = site_packages / LOCK_FILE

    def backup_path(self, relpath: str) -> Path:
        return self.dir / "backups" / relpath

    def staged_path(self, relpath: str) -> Path:
        return self.dir / "staged" / relpath

    def load(self) -> Manifest | None:
        try:
            text = self.manifest_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise EnvironmentProblem(
                f"unreadable state {self.manifest_path}", str(exc), f"inspect or remove {self.dir}"
            ) from None
        return Manifest.from_json(text, self.manifest_path)

    def save(self, manifest: Manifest) -> None:
        atomic_write(self.manifest_path, manifest.to_json().encode())

    def remove(self) -> None:
        """Drop the whole state: manifest first, so a crash leaves no half state behind."""
        self.manifest_path.unlink(missing_ok=True)
        _fsync_dir(self.dir) if self.dir.exists() else None
        shutil.rmtree(self.dir, ignore_errors=True)

    def clear_staged(self) -> None:
        shutil.rmtree(self.dir / "staged", ignore_errors=True)

    @contextmanager
    def lock(self, timeout: float) -> Iterator[None]:
        """An exclusive lock on this environment, waited on up to ``timeout`` seconds.

        The lock file may be unlinked by a revert while others wait on it, so
        after taking the lock we check that the path still names the file we hold.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise EnvironmentProblem(
                    f"cannot create the lock {self.lock_path}", exc.strerror or str(exc), "check the permissions"
                ) from None
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        os.close(fd)
                        raise
                    if time.monotonic() >= deadline:
                        os.close(fd)
                        raise EnvironmentProblem(
                            f"lock {self.lock_path} not obtained within {timeout:g} s",
                            "another patch-dsv4 holds it",
                            "wait for it, or raise --lock-timeout",
                        ) from None
                    time.sleep(0.05)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            yield
        finally:
            # Leave nothing behind. Safe while we hold the lock: a waiter that
            # opened this file notices the unlinked inode above and starts over.
            self.lock_path.unlink(missing_ok=True)
            os.close(fd)
