"""File operations that stay inside the environment and never leave a file half-written.

patch-dsv4 runs as root over trees that other users can write to, so every
operation here is made through an open directory (``dir_fd``): a symlink put in
place after a check cannot redirect it. The rules:

- a path taken from the state is relative and normalised (:func:`checked_relpath`);
- a file of the vLLM package is reached only where it resolves inside the real
  location of the ``vllm/`` package (:class:`PackageTree`), and is read only if
  it is a regular file (a FIFO never blocks a read, a directory is never read);
- the state directory and everything under it are real directories and regular
  files, never followed through a symlink (:class:`Dir` with ``O_NOFOLLOW``);
- a file is replaced by writing a temp file beside it (``O_CREAT | O_EXCL |
  O_NOFOLLOW``, a name no one can predict), fsync, then ``os.replace``: readers
  see the old or the new file; the new file keeps the old one's owner, group
  and mode.

Every write step first calls :func:`checkpoint`, the documented seam through
which tests inject a failure (:func:`inject_faults`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from patch_dsv4.tree.manifest_rules import UnsafePath, checked_relpath

#: Source files bigger than this are not plausible Python modules; they are never read whole.
MAX_SOURCE_BYTES = 32 << 20
_CHUNK = 1 << 20
_TEMP_RE = re.compile(r"\.(?P<name>.+)\.patch-dsv4-[0-9a-f]{32}\.tmp")

# -- the fault-injection seam -------------------------------------------------------
_fault_hook: Callable[[str], None] | None = None


def checkpoint(step: str) -> None:
    """Called before every write step (and at a few named points such as ``"judged"``).

    ``step`` is ``"<operation>:<file name>"`` (``mkdir``, ``create``, ``write``,
    ``fsync``, ``chown``, ``replace``, ``unlink``, ``rmdir``, ``link``) or a
    named point of the transaction. A hook installed with :func:`inject_faults`
    may raise (an ``OSError`` plays a failing disk) or end the process.
    """
    if _fault_hook is not None:
        _fault_hook(step)


@contextmanager
def inject_faults(hook: Callable[[str], None]) -> Iterator[None]:
    """Install ``hook`` as the fault hook for the duration of the block (tests only)."""
    global _fault_hook
    previous, _fault_hook = _fault_hook, hook
    try:
        yield
    finally:
        _fault_hook = previous


def set_fault_hook(hook: Callable[[str], None] | None) -> None:
    """Install ``hook`` for the rest of the process (a test script that is killed at a step)."""
    global _fault_hook
    _fault_hook = hook


# -- paths -----------------------------------------------------------------------
def is_temp_name(name: str) -> bool:
    """Whether ``name`` is the name of one of our temp files."""
    return _TEMP_RE.fullmatch(name) is not None


def _fd_location(fd: int) -> str | None:
    """Where an open file really is (Linux: /proc/self/fd), None when the system cannot say."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_fd(fd: int) -> str:
    digest = hashlib.sha256()
    while True:
        chunk = os.read(fd, _CHUNK)
        if not chunk:
            return digest.hexdigest()
        digest.update(chunk)


def _read_fd(fd: int, limit: int | None) -> bytes:
    size = os.fstat(fd).st_size
    if limit is not None and size > limit:
        raise OSError(errno.EFBIG, f"{size} bytes, more than a source file can plausibly be")
    chunks = []
    while True:
        chunk = os.read(fd, _CHUNK)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        if limit is not None and sum(map(len, chunks)) > limit:
            raise OSError(errno.EFBIG, "more bytes than a source file can plausibly be")


def describe(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a symbolic link (not followed)"
    return exc.strerror or str(exc)


class DanglingLink(OSError):
    """A symbolic link whose target does not exist: present, but not readable."""


@dataclass(frozen=True)
class Owner:
    uid: int
    gid: int
    mode: int


# -- open directories ----------------------------------------------------------------
class Dir:
    """An open directory: every operation is relative to its descriptor."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def open(cls, path: Path, follow: bool = True) -> Dir:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        try:
            return cls(os.open(path, flags), path)
        except OSError as exc:
            raise UnsafePath(f"cannot open the directory {path}", describe(exc)) from None

    def child(self, name: str, create_mode: int | None = None, owner: Owner | None = None) -> Dir | None:
        """The real subdirectory ``name`` (never a symlink); created when ``create_mode`` is given.

        None when it does not exist and is not to be created.
        """
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return Dir(os.open(name, flags, dir_fd=self.fd), self.path / name)
        except FileNotFoundError:
            if create_mode is None:
                return None
        except OSError as exc:
            st = self.lstat(name)
            why = "a symbolic link (not followed)" if st is not None and stat.S_ISLNK(st.st_mode) else describe(exc)
            raise UnsafePath(f"{self.path / name} is not a directory of ours", why) from None
        checkpoint(f"mkdir:{name}")
        os.mkdir(name, create_mode, dir_fd=self.fd)
        child = Dir(os.open(name, flags, dir_fd=self.fd), self.path / name)
        if owner is not None:
            _apply_owner(child.fd, owner, create_mode)
        return child

    def make_dir(self, name: str, mode: int, owner: Owner | None = None) -> bool:
        """Create the subdirectory ``name`` exclusively; False when something of that name exists already."""
        checkpoint(f"mkdir:{name}")
        try:
            os.mkdir(name, mode, dir_fd=self.fd)
        except FileExistsError:
            return False
        if owner is not None:
            with self.child(name) as child:
                _apply_owner(child.fd, owner, mode)
        return True

    def walk_to(self, parts: tuple[str, ...], create_mode: int | None = None, owner: Owner | None = None) -> Dir | None:
        """The real subdirectory at ``parts`` below this one, each part a real directory."""
        current: Dir | None = Dir(os.dup(self.fd), self.path)
        for part in parts:
            nxt = current.child(part, create_mode, owner)
            current.close()
            if nxt is None:
                return None
            current = nxt
        return current

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def open_regular(self, name: str, follow: bool = False) -> int:
        """A read descriptor of the regular file ``name``: never blocks (FIFO), never a directory."""
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        fd = os.open(name, flags, dir_fd=self.fd)
        return _regular(fd)

    def read_bytes(self, name: str, follow: bool = False, limit: int | None = None) -> bytes:
        fd = self.open_regular(name, follow)
        try:
            return _read_fd(fd, limit)
        finally:
            os.close(fd)

    def sha256(self, name: str, follow: bool = False) -> str | None:
        """sha256 of the regular file ``name``, read in chunks; None when it does not exist."""
        try:
            fd = self.open_regular(name, follow)
        except FileNotFoundError:
            return None
        try:
            return _sha256_fd(fd)
        finally:
            os.close(fd)

    def probe_writable(self, name: str, data: bytes) -> None:
        """Prove that ``name`` can be replaced with ``data`` here, changing nothing.

        The file itself must be writable (an immutable or append-only file, or
        one this user may not write, fails here), and a temp file holding all of
        ``data`` must fit beside it (a read-only or full file system fails here).
        """
        st = self.lstat(name)
        if st is not None and stat.S_ISREG(st.st_mode):  # a link is replaced, never opened
            fd = os.open(name, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
            os.close(fd)
        tmp = self._create_temp(name)
        try:
            _write_all(tmp[1], data, name)
            os.fsync(tmp[1])
        finally:
            os.close(tmp[1])
            os.unlink(tmp[0], dir_fd=self.fd)

    def _create_temp(self, name: str) -> tuple[str, int]:
        while True:
            tmp = f".{name}.patch-dsv4-{secrets.token_hex(16)}.tmp"
            checkpoint(f"create:{name}")
            try:
                fd = os.open(
                    tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd
                )
            except FileExistsError:  # someone planted this name: never touch it, take another
                continue
            return tmp, fd

    def _filled_temp(self, name: str, data: bytes, owner: Owner) -> str:
        """A new temp file beside ``name`` holding ``data`` with ``owner``, synced to disk; removed if that fails."""
        tmp, fd = self._create_temp(name)
        try:
            try:
                _write_all(fd, data, name)
                _apply_owner(fd, owner, owner.mode)
                checkpoint(f"fsync:{name}")
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            self._discard(tmp)
            raise
        return tmp

    def _discard(self, tmp: str) -> None:
        try:
            os.unlink(tmp, dir_fd=self.fd)
        except OSError:
            pass

    def write_atomic(self, name: str, data: bytes, owner: Owner) -> None:
        """Replace ``name`` by ``data`` (temp file, fsync, rename): readers see old or new, never a mix.

        A symlink at ``name`` is replaced by a regular file, never written through.
        """
        tmp = self._filled_temp(name, data, owner)
        try:
            checkpoint(f"replace:{name}")
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self._discard(tmp)
            raise
        self.fsync()

    def create_new(self, name: str, data: bytes, owner: Owner) -> bool:
        """Create ``name`` with ``data``, complete or not at all, never replacing what is there; whether it did."""
        tmp = self._filled_temp(name, data, owner)
        try:
            checkpoint(f"link:{name}")
            try:
                os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
            except FileExistsError:
                return False
        finally:
            self._discard(tmp)
        self.fsync()
        return True

    def unlink(self, name: str, missing_ok: bool = True) -> bool:
        """Remove ``name`` (a file or a link, never followed); whether it was there."""
        checkpoint(f"unlink:{name}")
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            if missing_ok:
                return False
            raise
        return True

    def move_to(self, name: str, dest: Dir, dest_name: str) -> None:
        """Move the entry ``name`` (a file, a link, a directory: never followed) to ``dest_name`` in ``dest``, on
        the same file system; the caller makes sure nothing is there."""
        checkpoint(f"rename:{name}")
        os.rename(name, dest_name, src_dir_fd=self.fd, dst_dir_fd=dest.fd)
        dest.fsync()
        self.fsync()

    def rmdir(self, name: str) -> None:
        checkpoint(f"rmdir:{name}")
        os.rmdir(name, dir_fd=self.fd)

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def remove_tree(self, name: str) -> None:
        """Remove the real directory ``name`` and everything in it; links are removed, never followed."""
        sub = self.child(name)
        if sub is None:
            return
        with sub:
            for entry in sub.names():
                st = sub.lstat(entry)
                if st is not None and stat.S_ISDIR(st.st_mode):
                    sub.remove_tree(entry)
                else:
                    sub.unlink(entry)
        self.rmdir(name)

    def remove_stray_temps(self, name: str) -> None:
        """Remove regular temp files a killed writer of ``name`` left here (links are left alone)."""
        for entry in self.names():
            found = _TEMP_RE.fullmatch(entry)
            if found and found["name"] == name:
                st = self.lstat(entry)
                if st is not None and stat.S_ISREG(st.st_mode):
                    self.unlink(entry)

    def fsync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError:  # some file systems refuse fsync on directories; the rename stands
            pass


def _write_all(fd: int, data: bytes, name: str) -> None:
    view = memoryview(data)
    while view:
        checkpoint(f"write:{name}")
        written = os.write(fd, view[:_CHUNK])
        view = view[written:]


def _apply_owner(fd: int, owner: Owner, mode: int) -> None:
    """Give a new file or directory the owner, group and mode it must have.

    Only root can give a file away; anyone else keeps their own (which is who
    owns what they could write anyway).
    """
    checkpoint("chown:")
    if os.geteuid() == 0:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (owner.uid, owner.gid):
            os.fchown(fd, owner.uid, owner.gid)
    os.fchmod(fd, mode)


# -- the vLLM package ------------------------------------------------------------------
class PackageTree:
    """The files of one installed vLLM; written only where they resolve inside its package.

    ``site`` is the directory holding ``vllm/``. The package's real location is
    where ``site/vllm`` resolves (a linked ``vllm/`` is a layout people use); a
    file is written only through a directory that resolves inside it, so a link
    deeper in the tree that leads elsewhere is refused (:meth:`parent_dir`).
    """

    def __init__(self, site: Path, package: str = "vllm") -> None:
        self.site = site
        self.package = package
        root = Dir.open(site / package)
        try:
            self.real_root = _fd_location(root.fd) or os.path.realpath(site / package)
        finally:
            root.close()

    def parent_dir(self, relpath: str) -> tuple[Dir, str]:
        """The open directory holding ``relpath`` and the file's name there, for writing.

        UnsafePath when that directory resolves outside the package.
        """
        parts = checked_relpath(relpath, "file")
        if parts[0] != self.package or len(parts) < 2:
            raise UnsafePath(f"{relpath} is not a file of the {self.package} package")
        directory = self.site.joinpath(*parts[:-1])
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise FileNotFoundError(exc.errno, f"{directory}: {describe(exc)}") from None
        where = _fd_location(fd) or os.path.realpath(directory)
        if not _inside(where, self.real_root):
            os.close(fd)
            raise UnsafePath(
                f"refusing {relpath}", f"{directory} resolves to {where}, outside the vLLM package at {self.real_root}"
            )
        return Dir(fd, directory), parts[-1]

    def check_file_link(self, directory: Dir, name: str) -> None:
        """A file that is itself a symlink must resolve inside the package too."""
        st = directory.lstat(name)
        if st is None or not stat.S_ISLNK(st.st_mode):
            return
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_PATH, dir_fd=directory.fd)
        except OSError as exc:
            raise FileNotFoundError(
                exc.errno, f"{directory.path / name}: a link that leads nowhere ({describe(exc)})"
            ) from None
        try:
            where = _fd_location(fd) or os.path.realpath(directory.path / name)
        finally:
            os.close(fd)
        if not _inside(where, self.real_root):
            raise UnsafePath(
                f"refusing {directory.path / name}", f"a link to {where}, outside the vLLM package at {self.real_root}"
            )

    def read_contained(self, relpath: str) -> tuple[bytes, Owner]:
        """A file of the package and its owner, group and mode, read only where it resolves inside the package.

        The checks the write path makes (:meth:`parent_dir`, :meth:`check_file_link`) run before anything is
        read: a file replaced by a link that leads out of the package is refused (UnsafePath), so that nothing
        outside is ever copied into the state.
        """
        directory, name = self.parent_dir(relpath)
        with directory:
            self.check_file_link(directory, name)
            fd = directory.open_regular(name, follow=True)
            try:
                st = os.fstat(fd)
                return _read_fd(fd, MAX_SOURCE_BYTES), Owner(st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))
            finally:
                os.close(fd)

    def _open_for_reading(self, relpath: str) -> int:
        """A descriptor of a regular file of the package, links followed (reading is harmless).

        Only writes are confined to the package; a read never blocks (FIFO),
        never reads a directory or a device, and tells a link that leads
        nowhere from an absent file.
        """
        parts = checked_relpath(relpath, "file")
        path = self.site.joinpath(*parts)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            if os.path.lexists(path):
                raise DanglingLink(f"{relpath} is a symbolic link that leads nowhere") from None
            raise
        return _regular(fd)

    def read(self, relpath: str, limit: int | None = MAX_SOURCE_BYTES) -> bytes:
        """The bytes of a regular file of the package.

        FileNotFoundError when absent; another OSError when it is not a regular
        file, a dangling link, too big, or cannot be read.
        """
        fd = self._open_for_reading(relpath)
        try:
            return _read_fd(fd, limit)
        finally:
            os.close(fd)

    def sha256(self, relpath: str) -> str | None:
        """sha256 of a file of the package, read in chunks.

        None when absent, not a regular file, or bigger than any source file
        (such a file is not one we wrote, and hashing it is not worth minutes).
        """
        try:
            fd = self._open_for_reading(relpath)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size > MAX_SOURCE_BYTES:
                return None
            return _sha256_fd(fd)
        finally:
            os.close(fd)

    def stat(self, relpath: str) -> os.stat_result:
        directory, name = self.parent_dir(relpath)
        with directory:
            st = directory.lstat(name)
            if st is None:
                raise FileNotFoundError(errno.ENOENT, f"{directory.path / name} is absent")
            if stat.S_ISLNK(st.st_mode):
                self.check_file_link(directory, name)
                st = os.stat(name, dir_fd=directory.fd)
            return st


def _regular(fd: int) -> int:
    """``fd`` (opened non-blocking, so that a FIFO cannot hang the open) if it is a regular file, made blocking;
    otherwise it is closed and OSError(EINVAL) raised."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
