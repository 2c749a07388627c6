"""Files another tool owns: a file, or a directory above it, mounted over site-packages, or one that cannot be
replaced where it is.

A V4.1 kit may mount its own files over site-packages: a file (``docker run -v kit/model.py:/.../model.py``), a
whole directory (``-v kit/common:/.../deepseek_v4/common``), a tmpfs or an overlay. A file that lies on any mount
other than the one site-packages itself is on is another tool's: ``os.replace`` onto a mounted file fails (EBUSY),
and a write into a mounted directory lands in the other tool's files, not the image's (and once that mount is gone,
revert would "restore" files it never wrote). So it is named up front: ``status`` marks it, ``apply``, ``takeover``
and ``revert`` refuse it in the plan, before anything is written, and the guard and ``verify`` report it.

The mounts are read from ``/proc/self/mountinfo`` (patch_dsv4.tree.installed.MOUNTINFO; tests point it at a fixture
file), all of it:
each line is ``ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS``, with space,
tab, newline and backslash in paths written as octal escapes (``\\040``). The mount a path is on is found as the
kernel finds it: from the root mount down, at each step the child mount (PARENT is the mount it was mounted on) at
the shallowest mount point on the path, the last of several on one point (:func:`mount_of`): a mount that a later
one on a directory above hides is passed over. ROOT is the mounted directory's or file's path inside its own file
system (a bind mount's source). Besides mounts, a file on a read-only file system, or marked immutable or
append-only (``chattr +i``/``+a``), or in a directory so marked, cannot be replaced either. Whether this user may
write there is not judged here (``status`` runs as anyone; ``apply`` proves it can write every file before it
writes one).

Used by verify's fast path and the guard: the standard library only (os; fcntl where a flag is asked about), and
patch_dsv4.tree.installed, which reads the table.
"""

import os

from patch_dsv4.tree import installed

#: What a user should do about another tool's overlay (the refusal's and the notes' reason ends with it).
OVERLAY = "another tool's overlay; patch the image it comes from"
_FS_IOC_GETFLAGS = 0x80086601  # linux/fs.h: the inode flags (ioctl), as lsattr reads them
_FS_IMMUTABLE_FL, _FS_APPEND_FL = 0x10, 0x20
_ST_RDONLY = 1  # os.ST_RDONLY


class Mount:
    """One line of the mount table: where it is mounted, and what is mounted there."""

    __slots__ = ("mount_id", "parent_id", "mount_point", "root", "fstype", "source")

    def __init__(
        self, mount_point: str, root: str, fstype: str, source: str, mount_id: int = 0, parent_id: int = 0
    ) -> None:
        self.mount_point, self.root, self.fstype, self.source = mount_point, root, fstype, source
        self.mount_id, self.parent_id = mount_id, parent_id

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
        try:
            mount_id, parent_id = int(fields[0]), int(fields[1])
        except ValueError:
            continue
        mounts.append(
            Mount(
                unescape(fields[4]),
                unescape(fields[3]),
                unescape(fields[separator + 1]),
                unescape(fields[separator + 2]),
                mount_id,
                parent_id,
            )
        )
    return mounts


def read_mounts() -> list[Mount]:
    """The mounts of this process (patch_dsv4.tree.installed.mount_table); none where it cannot be read."""
    return parse(installed.mount_table())


def _on_path(point: str, real: str) -> bool:
    return real == point or point == "/" or real.startswith(point + "/")


def mount_of(real: str, mounts: list[Mount]) -> Mount | None:
    """The mount the real path ``real`` is on, as the kernel resolves it: from the root mount, the child mount on
    the path with the shallowest mount point (the last of several on one point), again from there, until none; a
    mount a later mount on a directory above it hides is not reached. None where the table has no root mount."""
    ids = {m.mount_id for m in mounts}
    children: dict[int, list[Mount]] = {}
    for mount in mounts:
        children.setdefault(mount.parent_id, []).append(mount)
    roots = [m for m in mounts if m.mount_point == "/" and (m.parent_id not in ids or m.parent_id == m.mount_id)]
    if not roots:
        return None
    current = roots[-1]
    while True:
        best = None
        for child in children.get(current.mount_id, ()):
            if child is current or not _on_path(child.mount_point, real):
                continue
            if best is None or len(child.mount_point) <= len(best.mount_point):
                best = child  # the shallowest; of several on one point, the last
        if best is None:
            return current
        current = best


def foreign_mount(site_packages: str, path: str, mounts: list[Mount]) -> str | None:
    """Why the file ``path`` (of ``site_packages``) lies on another mount than site-packages itself, in one line;
    None where it is on site-packages' own mount."""
    site = os.path.realpath(site_packages)
    real = os.path.realpath(path)
    here, there = mount_of(site, mounts), mount_of(real, mounts)
    if there is None or there is here:
        return None
    if there.mount_point == real:
        return f"bind-mounted over site-packages from {there.origin}: {OVERLAY}"
    point = there.mount_point
    shown = point[len(site) + 1 :] + "/" if point.startswith(site + "/") else point
    return f"{shown} is mounted over site-packages ({there.fstype} from {there.origin}): {OVERLAY}"


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
    """Why the file at ``path`` cannot be replaced where it is (a read-only file system, an immutable or
    append-only flag), in one line; None when nothing says so. Mounts: :func:`foreign_mount`."""
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
        why = foreign_mount(site_packages, path, mounts) or why_unreplaceable(path, mounts)
        if why is not None:
            found[relpath] = why
    return found


def mounted(site_packages: str, relpaths, mounts: list[Mount] | None = None) -> dict[str, str]:
    """Of ``relpaths`` (files, or directories such as the state's), those on another mount than site-packages
    itself (the file, or a directory above it, a mount point below site-packages: :func:`foreign_mount`), and the
    one-line reason: the mount table only (``mounts``: the table, when read already)."""
    mounts = read_mounts() if mounts is None else mounts
    if not mounts:
        return {}
    found = {}
    for relpath in relpaths:
        path = os.path.join(site_packages, relpath)
        why = foreign_mount(site_packages, path, mounts) or _mounted_inside(site_packages, path, mounts)
        if why is not None:
            found[relpath] = why
    return found


def _mounted_inside(site_packages: str, path: str, mounts: list[Mount]) -> str | None:
    """Why the directory ``path`` holds a mount point of another file system (a mount over ``.patch-dsv4/backups``
    takes the backups written there, and takes them away with it); None where none lies below it."""
    real = os.path.realpath(path)
    here = mount_of(os.path.realpath(site_packages), mounts)
    for mount in mounts:
        if mount.mount_point.startswith(real + "/") and mount is not here:
            site = os.path.realpath(site_packages)
            point = mount.mount_point
            shown = point[len(site) + 1 :] if point.startswith(site + "/") else point
            return (
                f"{shown}/ is mounted there ({mount.fstype} from {mount.origin}): what is written there goes to "
                "another file system; unmount it first"
            )
    return None
