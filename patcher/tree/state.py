"""What patch-dsv4 keeps in the target environment: the manifest, the backups, the lock.

Layout, inside the site-packages directory that holds vllm/:

    .patch-dsv4.lock              one lock per environment (removed by every command)
    .patch-dsv4/manifest.json     the Manifest (schema-versioned JSON)
    .patch-dsv4/backups/<path>    each patched file as it was before we wrote it
    .patch-dsv4/staged/<path>     new contents, only while an apply is in flight

Nothing in the state is trusted: a manifest is read whole (by
:func:`patch_dsv4.tree.installed.read_state`, as the fast paths read it: at most
MANIFEST_LIMIT bytes, refused from its size beyond) and checked field by field
(every path relative, normalised and one of the files the patches declare)
before anything acts on it, and the state directory, its parts and the backups
must be real directories and regular files, never symlinks. A state that breaks
any rule is unreadable: exit 2, nothing written, nothing deleted.

Older versions kept ``stat-keys.json`` beside the manifest (file attributes
standing for files' sha256). Nothing reads it now; any apply or revert removes
it (:meth:`StateStore.remove_legacy`), whatever it holds.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from patch_dsv4.output.errors import EnvironmentProblem
from patch_dsv4.tree import installed
from patch_dsv4.tree.fs import MAX_SOURCE_BYTES, Dir, Owner, describe, is_temp_name
from patch_dsv4.tree.manifest_rules import UnsafePath, check_manifest, checked_relpath

SCHEMA_VERSION = 2
STATE_DIR = ".patch-dsv4"
LOCK_FILE = ".patch-dsv4.lock"
MANIFEST = "manifest.json"
LEGACY = ("stat-keys.json",)  # written by older versions, read by none: removed by the next apply or revert
SAVED_EDITS = "saved-edits"  # hand edits kept by revert --discard-local-edits, what a rebuild set aside: never removed
UNREADABLE = MANIFEST + ".unreadable"  # an unreadable manifest a rebuild set aside, in a run under saved-edits/
BACKUPS = "backups"
FILE_MODE, DIR_MODE = 0o644, 0o755


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
    # The judgement the last write was based on, for verify's fast path: per
    # patch id its verdict, the sha256 of every file that judgement read, the
    # FlashInfer it saw, and the digest of the patch definitions that made it.
    verdicts: dict[str, dict] = field(default_factory=dict)
    inputs: dict[str, str | None] = field(default_factory=dict)
    flashinfer: dict[str, str | None] = field(default_factory=dict)
    patch_digest: str | None = None
    opt_in: list[str] = field(default_factory=list)  # opt-in patches asked for with `apply --with`
    transaction: dict | None = None
    schema: int = SCHEMA_VERSION

    def to_json(self) -> str:
        data = {
            "schema": SCHEMA_VERSION,
            "vllm_version": self.vllm_version,
            "tool_version": self.tool_version,
            "files": {
                rel: {"before": e.before, "after": e.after, "patches": list(e.patches)} for rel, e in self.files.items()
            },
            "verdicts": self.verdicts,
            "inputs": self.inputs,
            "flashinfer": self.flashinfer,
            "patch_digest": self.patch_digest,
            "opt_in": list(self.opt_in),
            "transaction": self.transaction,
        }
        return json.dumps(data, indent=2, sort_keys=True) + "\n"


def parse_manifest(text: str, declared: Iterable[str], patch_ids: Iterable[str]) -> Manifest:
    """The Manifest in ``text``, checked field by field; ValueError naming the first problem."""
    return manifest_from_data(installed.parse_json(text.encode("utf-8"), MANIFEST), declared, patch_ids)


def manifest_from_data(data: object, declared: Iterable[str], patch_ids: Iterable[str]) -> Manifest:
    """The Manifest of a parsed manifest document (:func:`check_manifest`'s rules); ValueError naming the first
    problem."""
    data = check_manifest(data, declared, patch_ids)
    return Manifest(
        vllm_version=data["vllm_version"],
        tool_version=data["tool_version"],
        files={
            rel: FileEntry(entry["before"], entry["after"], list(entry["patches"]))
            for rel, entry in data["files"].items()
        },
        verdicts=dict(data.get("verdicts", {})),
        inputs=dict(data.get("inputs", {})),
        flashinfer=dict(data.get("flashinfer", {})),
        patch_digest=data.get("patch_digest"),
        opt_in=list(data.get("opt_in", [])),
        transaction=data.get("transaction"),
        schema=data["schema"],
    )


class UnreadableManifest(EnvironmentProblem):
    """The manifest itself cannot be used (malformed, oversized, not a regular file, a field that breaks a rule),
    in a state directory that is one: apply and revert rebuild the state from proof
    (:func:`patch_dsv4.pipeline.commands.rebuild`), status and verify name that repair."""


class StateStore:
    """The state directory of one environment, reached without following symlinks.

    ``declared`` is every file the patches edit: the only paths a manifest may
    name. ``owner`` is who the state files belong to: the owner of the site
    directory, so that the environment's owner can revert what root applied.
    """

    def __init__(self, site_packages: Path, declared: Iterable[str], patch_ids: Iterable[str]) -> None:
        self.root = site_packages
        self.dir_path = site_packages / STATE_DIR
        self.manifest_path = self.dir_path / MANIFEST
        self.lock_path = site_packages / LOCK_FILE
        self.declared = frozenset(declared)
        self.patch_ids = frozenset(patch_ids)
        try:
            st = os.stat(site_packages)
        except OSError as exc:
            raise EnvironmentProblem(f"cannot read {site_packages}", exc.strerror or str(exc)) from None
        self.owner = Owner(st.st_uid, st.st_gid, FILE_MODE)
        self.dir_owner = Owner(st.st_uid, st.st_gid, DIR_MODE)

    # -- directories ------------------------------------------------------------
    def _site(self) -> Dir:
        return Dir.open(self.root)

    def unreadable(self, why: str) -> EnvironmentProblem:
        return EnvironmentProblem(
            f"unreadable state {self.dir_path}",
            why,
            f"inspect it; if vLLM is pristine, remove {self.dir_path} and run patch-dsv4 status",
        )

    def state_dir(self, create: bool = False) -> Dir | None:
        """The state directory itself; a symlink there is refused."""
        with self._site() as site:
            try:
                return site.child(STATE_DIR, DIR_MODE if create else None, self.dir_owner)
            except UnsafePath as exc:
                raise self.unreadable(exc.why or exc.what) from None

    def exists(self) -> bool:
        with self._site() as site:
            return site.lstat(STATE_DIR) is not None

    def copy_dir(self, kind: str, relpath: str, create: bool = False) -> tuple[Dir | None, str]:
        """The directory holding the ``kind`` ("backups" or "staged") copy of ``relpath``."""
        parts = checked_relpath(relpath)
        state = self.state_dir(create)
        if state is None:
            return None, parts[-1]
        with state:
            try:
                return state.walk_to((kind, *parts[:-1]), DIR_MODE if create else None, self.dir_owner), parts[-1]
            except UnsafePath as exc:
                raise self.unreadable(exc.why or exc.what) from None

    def read_copy(self, kind: str, relpath: str) -> bytes | None:
        """The bytes of a backup or staged copy: a regular file inside the state, never a link."""
        directory, name = self.copy_dir(kind, relpath)
        if directory is None:
            return None
        with directory:
            try:
                return directory.read_bytes(name, limit=MAX_SOURCE_BYTES)  # a copy of a source file, no more
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise self.unreadable(f"the {kind} copy of {relpath} is {describe(exc)}") from None

    def write_copy(self, kind: str, relpath: str, data: bytes) -> None:
        directory, name = self.copy_dir(kind, relpath, create=True)
        with directory:
            directory.write_atomic(name, data, self.owner)

    def remove_copy(self, kind: str, relpath: str) -> None:
        directory, name = self.copy_dir(kind, relpath)
        if directory is not None:
            with directory:
                directory.unlink(name)

    # -- the manifest -------------------------------------------------------------
    def load(self) -> Manifest | None:
        """The manifest; None where there is none; unreadable (exit 2, naming it) where it breaks a rule."""
        try:
            data = installed.read_state(str(self.root))
        except installed.Unreadable as exc:
            if exc.path == MANIFEST:  # the file itself; a state directory that is not one is no state to rebuild
                raise self._unreadable_manifest(_short(exc)) from None
            raise self.unreadable(_short(exc)) from None
        if data is None:
            return None
        try:
            return manifest_from_data(data, self.declared, self.patch_ids)
        except (ValueError, RecursionError) as exc:  # field errors are ValueErrors
            raise self._unreadable_manifest(f"{MANIFEST}: {_short(exc)}") from None

    def _unreadable_manifest(self, why: str) -> UnreadableManifest:
        problem = self.unreadable(why)
        return UnreadableManifest(problem.what, problem.why, problem.next_step)

    def remove_legacy(self) -> bool:
        """Remove the files older versions kept in the state and this one reads nowhere (:data:`LEGACY`), whatever
        they hold (a cut or forged one included); whether there was one."""
        state = self.state_dir()
        if state is None:
            return False
        with state:
            found = [name for name in LEGACY if state.lstat(name) is not None]
            for name in found:
                state.unlink(name)
        return bool(found)

    def manifest_exists(self) -> bool:
        state = self.state_dir()
        if state is None:
            return False
        with state:
            return state.lstat(MANIFEST) is not None

    def remove_stray_temps(self) -> None:
        """Temp files a killed writer left where our writers write: the state directory itself, and the directories
        on the way to a file the patches edit under backups/, staged/ and each run under saved-edits/. Nothing else
        is walked, so that a hostile tree there costs nothing; links are never followed, one directory is open at a
        time."""
        state = self.state_dir()
        if state is None:
            return
        with state:
            bases = [(), (BACKUPS,), ("staged",)]
            if _is_dir(state.lstat(SAVED_EDITS)):
                with state.child(SAVED_EDITS) as saved:
                    bases += [(SAVED_EDITS, run) for run in saved.names() if _is_dir(saved.lstat(run))]
            prefixes = sorted(self._on_the_way())
            for base in bases:
                for prefix in prefixes:
                    directory = _real_dir(state, (*base, *prefix))
                    if directory is None:
                        continue
                    with directory:
                        for name in directory.names():
                            if is_temp_name(name) and stat.S_ISREG(getattr(directory.lstat(name), "st_mode", 0)):
                                directory.unlink(name)

    def _on_the_way(self) -> set[tuple[str, ...]]:
        """Each directory on the way to a file the patches edit, as parts below a copy's top (() for the top)."""
        return {tuple(rel.split("/")[:depth]) for rel in self.declared for depth in range(rel.count("/") + 1)}

    def holds_more_than_saved_edits(self) -> bool:
        """Whether the state directory holds anything but saved local edits (which never make a state)."""
        state = self.state_dir()
        if state is None:
            return False
        with state:
            return any(name != SAVED_EDITS for name in state.names())

    def save(self, manifest: Manifest) -> None:
        data = manifest.to_json().encode()
        if len(data) > installed.MANIFEST_LIMIT:  # never write a manifest that every reader refuses
            raise EnvironmentProblem(
                f"cannot write {self.manifest_path}",
                f"it would be {len(data):,} bytes, more than a manifest may be ({installed.MANIFEST_LIMIT:,})",
                "report it: this is a bug in patch-dsv4",
            )
        state = self.state_dir(create=True)
        with state:
            state.write_atomic(MANIFEST, data, self.owner)

    def remove(self) -> None:
        """Drop the state, manifest first, so a crash never leaves a manifest without its backups.

        Local edits saved by ``revert --discard-local-edits`` are the user's: they stay.
        """
        state = self.state_dir()
        if state is None:
            return
        with state:
            state.unlink(MANIFEST)
            state.fsync()
            for name in state.names():
                if name == SAVED_EDITS:
                    continue
                st = state.lstat(name)
                if st is not None and stat.S_ISDIR(st.st_mode):
                    state.remove_tree(name)
                else:
                    state.unlink(name)
            keep = state.lstat(SAVED_EDITS) is not None
        if not keep:
            with self._site() as site:
                site.rmdir(STATE_DIR)

    def remove_if_empty(self) -> bool:
        """Remove a state directory that holds nothing (left by a run killed before it wrote anything)."""
        state = self.state_dir()
        if state is None:
            return False
        with state:
            if state.names():
                return False
        with self._site() as site:
            site.rmdir(STATE_DIR)
        return True

    def new_saved_edits_run(self) -> str:
        """A fresh directory for the local edits one run saves, created exclusively: a later run in the same
        second gets another (``<stamp>-2``, ...), so nothing saved is ever replaced. Its name."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        state = self.state_dir(create=True)
        with state:
            saved = state.child(SAVED_EDITS, DIR_MODE, self.dir_owner)
        with saved:
            for n in range(1, 1000):
                name = stamp if n == 1 else f"{stamp}-{n}"
                if saved.make_dir(name, DIR_MODE, self.dir_owner):
                    return name
        raise EnvironmentProblem(
            f"cannot make a directory under {self.dir_path / SAVED_EDITS}", "too many runs this second"
        )

    def save_local_edit(self, run: str, relpath: str, data: bytes, owner: Owner) -> Path:
        """Keep a hand-edited file in ``run`` (:meth:`new_saved_edits_run`) before it is replaced; where it was saved.

        ``owner`` is the original's owner, group and mode: the copy is never readable by more than the file was.
        """
        parts = checked_relpath(relpath)
        state = self.state_dir(create=True)
        with state:
            directory = state.walk_to((SAVED_EDITS, run, *parts[:-1]), DIR_MODE, self.dir_owner)
        with directory:
            if not directory.create_new(parts[-1], data, owner):
                raise EnvironmentProblem(f"cannot save {relpath}", f"{directory.path / parts[-1]} exists already")
        return self.dir_path / SAVED_EDITS / run / relpath

    def backup_entries(self) -> dict[str, bool]:
        """Every entry under backups/ (its path there -> whether it is a regular file), whatever the manifest says:
        a link, a FIFO or the like is named, never followed or opened. Only the directories on the way to a file the
        patches edit are walked, one open at a time; any other directory (a link to one too) is one entry, moved
        aside whole, so that a hostile tree costs no more than the declared paths. A killed writer's temp files are
        left out (recovery removes them)."""
        state = self.state_dir()
        if state is None:
            return {}
        with state:
            try:
                top = state.child(BACKUPS) if state.lstat(BACKUPS) is not None else None
            except UnsafePath as exc:
                raise self.unreadable(exc.why or exc.what) from None
        if top is None:
            return {}
        on_the_way = self._on_the_way()
        found: dict[str, bool] = {}
        with top:
            pending: list[tuple[str, ...]] = [()]
            while pending:
                prefix = pending.pop()
                directory = top.walk_to(prefix)
                if directory is None:
                    continue
                with directory:
                    for name in directory.names():
                        st = directory.lstat(name)
                        if st is None or is_temp_name(name):
                            continue
                        if stat.S_ISDIR(st.st_mode) and (*prefix, name) in on_the_way:
                            pending.append((*prefix, name))
                        else:
                            found["/".join((*prefix, name))] = stat.S_ISREG(st.st_mode)
        return dict(sorted(found.items()))

    def keep_aside(self, manifest: bool, backups: Iterable[str]) -> str:
        """Move the unreadable manifest (``manifest``) and ``backups`` (paths under backups/, as
        :meth:`backup_entries` names them) into a fresh run under saved-edits/, which nothing removes: the manifest
        as manifest.json.unreadable, each backup at its path under backups/ there. The run's path under the site
        directory."""
        run = self.new_saved_edits_run()
        state = self.state_dir()
        with state:
            kept = state.walk_to((SAVED_EDITS, run))
            with kept:
                if manifest:
                    state.move_to(MANIFEST, kept, UNREADABLE)
                for relpath in backups:
                    parts = tuple(relpath.split("/"))
                    source = state.walk_to((BACKUPS, *parts[:-1]))
                    dest = kept.walk_to((BACKUPS, *parts[:-1]), DIR_MODE, self.dir_owner)
                    with source, dest:
                        source.move_to(parts[-1], dest, parts[-1])
        return f"{STATE_DIR}/{SAVED_EDITS}/{run}/"

    def clear_staged(self) -> None:
        state = self.state_dir()
        if state is not None:
            with state:
                state.remove_tree("staged")

    def has_staged(self) -> bool:
        """Whether ``staged/`` is there, copies in it or not (an apply interrupted while it removed them)."""
        state = self.state_dir()
        if state is None:
            return False
        with state:
            return state.lstat("staged") is not None

    def copies(self, kind: str) -> list[str]:
        """Relative paths of every regular file under backups/ or staged/ (links are reported as unreadable)."""
        state = self.state_dir()
        if state is None:
            return []
        found: list[str] = []
        with state:
            top = state.child(kind) if state.lstat(kind) is not None else None
            if top is None:
                return []
            self._collect(top, (), found)
        return found

    def _collect(self, directory: Dir, prefix: tuple[str, ...], found: list[str]) -> None:
        with directory:
            for name in directory.names():
                st = directory.lstat(name)
                if st is None:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    self._collect(directory.child(name), (*prefix, name), found)
                elif is_temp_name(name):
                    continue  # a killed writer's temp file: recovery removes it
                elif stat.S_ISREG(st.st_mode):
                    found.append("/".join((*prefix, name)))
                else:
                    raise self.unreadable(f"{'/'.join((*prefix, name))} is not a regular file")

    # -- the lock ---------------------------------------------------------------------
    @contextmanager
    def lock(self, timeout: float, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """An exclusive lock on this environment, waited on up to ``timeout`` seconds.

        The lock file holds the holder's pid and start time, so that a waiter
        can say who it waits for (``on_wait`` is called once, after a second).
        A revert may unlink the file while others wait on it: after taking the
        lock we check that the path still names the file we hold.
        """
        self._check_timeout(timeout)
        deadline = time.monotonic() + timeout
        told = False
        started = time.monotonic()
        while True:
            fd = self._open_lock()
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        os.close(fd)
                        raise
                    if on_wait is not None and not told and time.monotonic() - started >= 1.0:
                        told = True
                        on_wait(self._holder(fd))
                    if time.monotonic() >= deadline:
                        holder = self._holder(fd)
                        os.close(fd)
                        raise EnvironmentProblem(
                            f"lock {self.lock_path} not obtained within {timeout:g} s",
                            f"held by {holder}",
                            "wait for it, or raise --lock-timeout",
                        ) from None
                    time.sleep(0.05)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            self._write_holder(fd)
            yield
        finally:
            # Leave nothing behind. Safe while we hold the lock: a waiter that
            # opened this file notices the unlinked inode above and starts over.
            try:
                os.unlink(self.lock_path)
            except FileNotFoundError:
                pass
            os.close(fd)

    @contextmanager
    def wait_unlocked(self, timeout: float, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """Wait (up to ``timeout``) until no one holds the lock, creating nothing: a dry run's check.

        The lock file is opened only if it exists, read-only; a run that starts
        after the check is what a real apply would have waited for too.
        """
        self._check_timeout(timeout)
        deadline = time.monotonic() + timeout
        started, told = time.monotonic(), False
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                break
            except OSError as exc:
                why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
                raise EnvironmentProblem(
                    f"cannot open the lock {self.lock_path}", why, "check the permissions"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                holder = self._holder(fd)
            finally:
                os.close(fd)
            if on_wait is not None and not told and time.monotonic() - started >= 1.0:
                told = True
                on_wait(holder)
            if time.monotonic() >= deadline:
                raise EnvironmentProblem(
                    f"lock {self.lock_path} not free within {timeout:g} s",
                    f"held by {holder}",
                    "wait for it, or raise --lock-timeout",
                )
            time.sleep(0.05)
        yield

    @staticmethod
    def _check_timeout(timeout: float) -> None:
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout >= 0):
            raise EnvironmentProblem(
                f"--lock-timeout {timeout} is not a number of seconds",
                "it must be finite and not negative",
                "e.g. --lock-timeout 300",
            )

    def _open_lock(self) -> int:
        flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | flags, FILE_MODE)
            except PermissionError:
                fd = os.open(self.lock_path, os.O_RDONLY | flags, FILE_MODE)  # flock needs no write access
        except OSError as exc:
            why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
            raise EnvironmentProblem(f"cannot open the lock {self.lock_path}", why, "check the permissions") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise EnvironmentProblem(
                f"cannot use the lock {self.lock_path}", "it is not a regular file", f"remove {self.lock_path}"
            )
        if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (self.owner.uid, self.owner.gid) and st.st_size == 0:
            try:
                os.fchown(fd, self.owner.uid, self.owner.gid)
            except OSError:
                pass
        return fd

    def _write_holder(self, fd: int) -> None:
        text = f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, text, 0)
        except OSError:  # a read-only lock file still locks; the holder is just not named
            pass

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            text = installed.holder_text(os.pread(fd, installed.LOCK_LIMIT, 0))
        except OSError:
            text = ""
        return text or "another patch-dsv4 process"


def _short(exc: BaseException) -> str:
    text = str(exc) if not isinstance(exc, RecursionError) else "nested too deeply"
    return text if len(text) <= 160 else text[:157] + "..."


def _is_dir(st: os.stat_result | None) -> bool:
    return st is not None and stat.S_ISDIR(st.st_mode)


def _real_dir(top: Dir, parts: tuple[str, ...]) -> Dir | None:
    """The real directory at ``parts`` below ``top``, or None where a part is missing or not a real directory (a
    link is never followed): where nothing of ours can be."""
    current = Dir(os.dup(top.fd), top.path)
    for part in parts:
        with current:
            if not _is_dir(current.lstat(part)):
                return None
            nxt = current.child(part)
        if nxt is None:
            return None
        current = nxt
    return current
