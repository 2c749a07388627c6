"""Files another tool owns: a file bind-mounted over site-packages, or one that cannot be replaced where it is.

A V4.1 kit may bind-mount whole vLLM files over site-packages (``docker run -v kit/model.py:/.../model.py``). Such
a file is a mount point: ``os.replace`` onto it fails (EBUSY) and, were it to succeed, would write into the other
tool's overlay rather than the image. So it is named up front: ``status`` marks it, ``apply``, ``takeover`` and
``revert`` refuse it in the plan, before anything is written, and the guard and ``verify`` report it.

A mount point is read from ``/proc/self/mountinfo`` (:data:`MOUNTINFO`; tests point it at a fixture file): each
line is ``ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS``, with space, tab,
newline and backslash in paths written as octal escapes (``\\040``). A bind mount of a file shows as an entry whose
mount point is that file, and whose ROOT is the mounted file's path inside its own filesystem. Besides mounts, a
file on a read-only filesystem, or marked immutable or append-only (``chattr +i``/``+a``), or in a directory so
marked, cannot be replaced either. Whether this user may write there is not judged here (``status`` runs as anyone;
``apply`` proves it can write every file before it writes one).

Used by verify's fast path and the guard: the standard library only (os; fcntl where a flag is asked about).
"""

import os

#: The mount table read (a module attribute, so that tests can point it at a fixture file).
MOUNTINFO = "/proc/self/mountinfo"
#: What a user should do about another tool's overlay (the refusal's and the notes' reason ends with it).
OVERLAY = "another tool's overlay; patch the image it comes from"
_LIMIT = 8 << 20  # a mount table larger than this is read no further
_FS_IOC_GETFLAGS = 0x80086601  # linux/fs.h: the inode flags (ioctl), as lsattr reads them
_FS_IMMUTABLE_FL, _FS_APPEND_FL = 0x10, 0x20
_ST_RDONLY = 1  # os.ST_RDONLY


class Mount:
    """One line of the mount table: where it is mounted, and what is mounted there."""

    __slots__ = ("mount_point", "root", "fstype", "source")

    def __init__(self, mount_point: str, root: str, fstype: str, source: str) -> None:
        self.mount_point, self.root, self.fstype, self.source = mount_point, root, fstype, source

    def __repr__(self) -> str:
        return f"Mount({self.mount_point!r}, root={self.root!r}, fstype={self.fstype!r}, source={self.source!r})"

    @property
    def origin(self) -> str:
        """Where the mounted file comes from: its path inside its filesystem (a bind mount's), else the source."""
        return self.root if self.root not in ("", "/") else self.source


def unescape(field: bytes) -> str:
    """A path of the mount table: its octal escapes (``\\040`` for a space, ``\\134`` for a backslash) undone,
    decoded as the file system's names are (undecodable bytes kept, as os.fsdecode keeps them)."""
    if b"\\" in field:
        out = bytearray()
        i = 0
        while i < len(field):
            digits = field[i + 1 : i + 4]
            if field[i] == 0x5C and len(digits) == 3 and all(0x30 <= d <= 0x37 for d in digits):
                out.append(int(digits, 8) & 0xFF)
                i += 4
            else:
                out.append(field[i])
                i += 1
        field = bytes(out)
    return os.fsdecode(field)


def parse(data: bytes) -> list[Mount]:
    """The mounts of a mountinfo text, in its order (a later mount over the same point hides the earlier); a line
    that is not one of mountinfo's (too few fields, no ``-`` separator) is passed over."""
    mounts = []
    for line in data.split(b"\n"):
        fields = line.split(b" ")
        try:
            separator = fields.index(b"-", 6)
        except ValueError:
            continue
        if len(fields) < separator + 3 or len(fields) < 7:
            continue
        mounts.append(
            Mount(
                unescape(fields[4]),
                unescape(fields[3]),
                unescape(fields[separator + 1]),
                unescape(fields[separator + 2]),
            )
        )
    return mounts


def read_mounts(path: str | None = None) -> list[Mount]:
    """The mounts of this process (``path``: another mountinfo file); none where it cannot be read."""
    try:
        with open(MOUNTINFO if path is None else path, "rb") as fh:
            return parse(fh.read(_LIMIT))
    except OSError:
        return []


def mount_over(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount whose mount point is the file ``path`` (its real path), the last of them; None if it has none."""
    real = os.path.realpath(path)
    found = None
    for mount in mounts:
        if mount.mount_point == real:
            found = mount
    return found


def _flags(path: str) -> int:
    """The inode flags of ``path`` (0 where the file system has none or they cannot be read)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return 0
    try:
        buf = fcntl.ioctl(fd, _FS_IOC_GETFLAGS, b"\0\0\0\0")
        return int.from_bytes(buf, "little")
    except OSError:
        return 0
    finally:
        os.close(fd)


def why_unreplaceable(path: str, mounts: list[Mount]) -> str | None:
    """Why the file at ``path`` cannot be replaced where it is, in one line; None when nothing says so."""
    mount = mount_over(path, mounts)
    if mount is not None:
        return f"bind-mounted over site-packages from {mount.origin}: {OVERLAY}"
    real = os.path.realpath(path)
    directory = os.path.dirname(real)
    try:
        if os.statvfs(directory).f_flag & _ST_RDONLY:
            return "on a read-only file system: patch the image it comes from"
    except OSError:
        return None
    for where, what in ((real, "the file"), (directory, "its directory")):
        flags = _flags(where)
        if flags & _FS_IMMUTABLE_FL:
            return f"{what} is immutable (chattr +i): lsattr shows it; chattr -i it first, or patch the image"
        if flags & _FS_APPEND_FL:
            return f"{what} is append-only (chattr +a): lsattr shows it; chattr -a it first, or patch the image"
    return None


def unreplaceable(site_packages: str, relpaths, mounts: list[Mount] | None = None) -> dict[str, str]:
    """Of the files ``relpaths`` (relative to ``site_packages``) that exist, those that cannot be replaced, and why."""
    mounts = read_mounts() if mounts is None else mounts
    found = {}
    for relpath in relpaths:
        path = os.path.join(site_packages, relpath)
        if not os.path.lexists(path):
            continue
        why = why_unreplaceable(path, mounts)
        if why is not None:
            found[relpath] = why
    return found


def mounted(site_packages: str, relpaths, mounts: list[Mount] | None = None) -> dict[str, str]:
    """Of ``relpaths``, the files bind-mounted over ``site_packages``, and the one-line reason: the cheap check of
    verify's fast path and the guard (the mount table only; ``mounts``: the table, when read already)."""
    mounts = read_mounts() if mounts is None else mounts
    if not mounts:
        return {}
    found = {}
    for relpath in relpaths:
        mount = mount_over(os.path.join(site_packages, relpath), mounts)
        if mount is not None:
            found[relpath] = f"bind-mounted over site-packages from {mount.origin}: {OVERLAY}"
    return found
