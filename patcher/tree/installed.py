"""The one reader of the installed tree and of our state: the engine, verify's fast path and the guard read through it.

    dist-infos  :func:`find_dist` (a project on a search path, PEP 503 names), its METADATA's headers,
                :func:`read_record`, :func:`flashinfer_pin` (the release vLLM's requirements pin)
    state       :func:`read_state` (a JSON document of ``.patch-dsv4/``), :func:`lock_holder`
    files       :func:`read_file` (capped, regular files only), :func:`sha256_file`, :func:`sha256_hex`

Every read is capped at what its format needs (a larger file is refused unread, from its size), never blocks on a
FIFO, and reads our state without following a link. Whatever is malformed, oversized or not a regular file raises
:class:`Unreadable`, whose text is one line naming the file: the engine turns it into its exit-2 error, the guard
into its one warning, in bounded time and memory. JSON is read with :func:`json.loads` (ints of at most 20 digits,
no NaN or Infinity) and hashes are :func:`hashlib.sha256`: the standard library's public modules only.

Imported by the serve guard in every vLLM process: os and stat at module level; json and hashlib where a
function needs them (a vLLM process has both imported already before it calls its plugins).
"""

import errno
import os
import stat

STATE_DIR = ".patch-dsv4"
MANIFEST = "manifest.json"
LOCK_FILE = ".patch-dsv4.lock"

#: What each format needs, with room to grow (what a real one weighs, in the comment). A larger file is refused.
MANIFEST_LIMIT = 512 << 10  # 28 KB on 0.30.0 with every default patch: a few hundred edits' verdicts fit
METADATA_LIMIT = 1 << 20  # vLLM 0.30.0's is 11 KB (headers and README); FlashInfer's 8 KB
RECORD_LIMIT = 32 << 20  # vLLM 0.30.0's is 0.6 MB (5,600 files)
WHEEL_LIMIT = 64 << 10  # 103 bytes
SOURCE_LIMIT = 32 << 20  # a Python source file; vLLM's largest is under 1 MB
LOCK_LIMIT = 200  # the holder's "pid N since DATE" line
#: JSON values a state file may hold (counted as its commas and open brackets, before it is parsed): what json.loads
#: builds is bounded by this, not by the bytes (512 KiB of ``{},`` would be 175,000 objects, 13 MB, tens of ms).
STATE_VALUES = 20_000  # 0.30.0's manifest with every default patch: 490
METADATA_LINES = 2_000  # header lines of a METADATA read (vLLM 0.30.0's: 90)
_INT_DIGITS = 20  # JSON integers longer than this are refused: parsing one is quadratic before Python 3.11


class Unreadable(ValueError):
    """A file of the tree or of our state that cannot be used as it is: ``path`` and ``why``, one line."""

    def __init__(self, path: str, why: str, text: str | None = None) -> None:
        self.path, self.why = path, why
        super().__init__(text or f"{path} {why}")


class Ambiguous(Unreadable):
    """Two dist-infos of one project in one directory, and nothing tells which is installed."""


def _shown(data: bytes | str, limit: int = 60) -> str:
    """Text from a file, safe to print: control characters as ``?``, at most ``limit`` characters."""
    if isinstance(data, bytes):
        data = data.decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else "?" for c in data[:limit])
    return text + ("..." if len(data) > limit else "")


# -- files ----------------------------------------------------------------------------------
def _size_text(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f} {unit}"
    return f"{size} bytes"


def _open(path: str, what: str, follow: bool, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file ``path``; FileNotFoundError where there is none, Unreadable where
    it is anything else than a regular file that can be opened."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):  # a part of the path is a file: nothing there either
        raise FileNotFoundError(errno.ENOENT, "no such file", path) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise Unreadable(what, "is a symbolic link") from None
        raise Unreadable(what, f"cannot be opened ({exc.strerror or exc})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Unreadable(what, "is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd  # O_NONBLOCK kept: it changes nothing for a regular file's reads


def _read_fd(fd: int, what: str, limit: int, format_name: str) -> bytes:
    """All of an open regular file, refused from its size where it is over ``limit`` (and where it grows past it)."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise Unreadable(what, f"is {_size_text(size)}, more than {format_name} needs (at most {_size_text(limit)})")
    chunks, left = [], limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, max(size + 1, 1 << 16)))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    if left <= 0:
        raise Unreadable(what, f"grew past {_size_text(limit)} while it was read")
    return b"".join(chunks)


def read_file(path: str, limit: int, format_name: str = "its format", what: str | None = None) -> bytes:
    """All of the regular file ``path`` (links followed). FileNotFoundError where it is absent; Unreadable where it is
    not a regular file, cannot be read, or is larger than ``limit`` (refused from its size: nothing is read)."""
    what = what or path
    fd = _open(path, what, True)
    try:
        return _read_fd(fd, what, limit, format_name)
    except OSError as exc:
        raise Unreadable(what, f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def read_start(path: str, limit: int) -> tuple[bytes, bool]:
    """The first ``limit`` bytes of the regular file ``path`` (links followed), and whether that is all of it: for a
    file read in part (a hook scanned for names). FileNotFoundError where it is absent; Unreadable where it is not
    a regular file or cannot be read."""
    fd = _open(path, path, True)
    try:
        data = os.read(fd, limit + 1)
    except OSError as exc:
        raise Unreadable(path, f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    return data[:limit], len(data) <= limit


def sha256_hex(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def record_digest(data: bytes) -> str:
    """The sha256 of ``data`` as a wheel's RECORD writes it: urlsafe base64, unpadded (43 characters)."""
    import base64
    import hashlib

    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def holder_text(data: bytes) -> str:
    """Who holds a lock, as its file says: the first line, printable, at most LOCK_LIMIT characters."""
    return _shown(data[:LOCK_LIMIT].partition(b"\n")[0].strip(), LOCK_LIMIT)


def sha256_file(path: str, limit: int = SOURCE_LIMIT) -> str | None:
    """The sha256 of the regular file ``path`` (links followed), read to its end in this call; None where it is
    absent, not a regular file, larger than ``limit`` or unreadable (no sha256 stands for those)."""
    import hashlib

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        if st.st_size < 1 << 20:  # a source file: one read of its size and a byte more, which EOF cuts short
            data = os.read(fd, st.st_size + 1)
            if len(data) == st.st_size:
                return hashlib.sha256(data).hexdigest()
            if len(data) > st.st_size:
                return None  # it grew while read: not the file its status gave
            os.lseek(fd, 0, os.SEEK_SET)  # shorter than its status: read it to its end below
        digest = hashlib.sha256()
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
        return digest.hexdigest() if left > 0 else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _small_int(text: str) -> int:
    if len(text.lstrip("-")) > _INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def parse_json(data: bytes, what: str):
    """One UTF-8 JSON document (json.loads, strict: no NaN or Infinity, integers of at most 20 digits, no BOM);
    Unreadable naming ``what`` otherwise."""
    import json

    try:
        return json.loads(data.decode("utf-8"), parse_int=_small_int, parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise Unreadable(what, f"is not UTF-8 (byte {exc.start})") from None
    except RecursionError:
        raise Unreadable(what, "is not JSON: nested too deeply") from None
    except ValueError as exc:  # json's JSONDecodeError, and the hooks' refusals
        raise Unreadable(what, f"is not JSON: {_shown(str(exc), 100)}") from None


# -- our state ------------------------------------------------------------------------------
def read_state(site_packages: str, name: str = MANIFEST, limit: int = MANIFEST_LIMIT):
    """The JSON document ``.patch-dsv4/NAME`` holds; None where there is no state directory or no such file.

    Neither the directory nor the file is followed where it is a link. Unreadable (its text starts with
    ``.patch-dsv4`` or ``NAME``) where either is not what we write: a link, not a directory or regular file, over
    ``limit`` (refused from its size), not UTF-8 JSON.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_DIRECTORY
    try:
        state = os.open(os.path.join(site_packages, STATE_DIR), flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW | O_DIRECTORY on a link: ENOTDIR
            is_link = os.path.islink(os.path.join(site_packages, STATE_DIR))
            raise Unreadable(STATE_DIR, "is a symbolic link" if is_link else "is not a directory") from None
        raise Unreadable(STATE_DIR, f"cannot be opened ({exc.strerror or exc})") from None
    try:
        fd = _open(name, name, False, dir_fd=state)
    except FileNotFoundError:
        return None
    finally:
        os.close(state)
    try:
        data = _read_fd(fd, name, limit, "a patch-dsv4 state file")
    except OSError as exc:
        raise Unreadable(name, f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if data.count(b",") + data.count(b"[") + data.count(b"{") > STATE_VALUES:
        raise Unreadable(name, f"holds more than {STATE_VALUES:,} JSON values: one patch-dsv4 writes holds hundreds")
    return parse_json(data, name)


def lock_holder(site_packages: str) -> str | None:
    """Who holds the environment's lock (an apply or revert writing it now), or None; never waits, never blocks.

    Only a regular file is looked at (not through a link); its first line, printable, says who holds it.
    """
    try:
        fd = os.open(os.path.join(site_packages, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # none: every command removes it when it ends
    try:
        import fcntl

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None  # not a lock anyone holds: taking it is refused, naming it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return holder_text(os.pread(fd, LOCK_LIMIT, 0)) or "another patch-dsv4 process"
        return None
    finally:
        os.close(fd)


# -- the mount table -------------------------------------------------------------------------
#: The mount table read (a module attribute, so that tests can point it at a fixture file).
MOUNTINFO = "/proc/self/mountinfo"


def mount_table() -> bytes:
    """The whole mount table of this process (:data:`MOUNTINFO`), b"" where there is none. Read to its end, however
    long: a mount left out would be a mount not seen (patch_dsv4.tree.mounts reads its lines)."""
    try:
        with open(MOUNTINFO, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def mounts_below(site_packages: str, table: bytes) -> bool:
    """Whether the mount table may hold a mount point below ``site_packages`` (its real path): cheap, from the
    table's bytes, before anything is parsed. A path with a blank or a backslash (escaped in the table) counts."""
    real = os.path.realpath(site_packages)
    if any(c in real for c in " \t\n\\"):
        return True
    return os.fsencode(real + "/") in table


# -- dist-infos ------------------------------------------------------------------------------
def canonical(name: str) -> str:
    """A distribution's normalised name (PEP 503: each run of ``-``, ``_``, ``.`` one ``-``, lower case)."""
    name = name.lower().replace("_", "-").replace(".", "-")
    while "--" in name:
        name = name.replace("--", "-")
    return name


def metadata_headers(text: str) -> dict[str, list[str]]:
    """The headers of a METADATA (or PKG-INFO) text, lower-case name -> values in order: the lines before the first
    blank one (the description after it is not read); a continuation line is passed over. ValueError past
    METADATA_LINES header lines."""
    headers: dict[str, list[str]] = {}
    start = 0
    for _ in range(METADATA_LINES):
        end = text.find("\n", start)
        line = text[start : end if end >= 0 else len(text)].rstrip("\r")
        if not line.strip():
            return headers
        key, sep, value = line.partition(":")
        if sep and not line[0].isspace():
            headers.setdefault(key.strip().lower(), []).append(value.strip())
        if end < 0:
            return headers
        start = end + 1
    raise ValueError(f"more than {METADATA_LINES:,} header lines")


class DistInfo:
    """One installed distribution as its metadata directory gives it (a plain class: the guard builds no dataclass).

    ``root``: the directory holding the metadata directory (and the package); ``path``: the metadata directory;
    ``metadata``: its METADATA's bytes (build identities hash them).
    """

    __slots__ = ("name", "version", "root", "path", "headers", "metadata")

    def __init__(self, name: str, version: str, root: str, path: str, headers: dict, metadata: bytes) -> None:
        self.name, self.version, self.root, self.path = name, version, root, path
        self.headers, self.metadata = headers, metadata

    def requires(self) -> list[str]:
        return list(self.headers.get("requires-dist", []))

    def record(self) -> dict[str, str]:
        """RECORD's sha256 entries (path -> urlsafe-base64 sha256); Unreadable where it is missing or malformed."""
        return {rel: digest for rel, (algorithm, digest, _) in read_record(self.path).items() if algorithm == "sha256"}


def _metadata_dirs(directory: str, wanted: str, names: list[str]) -> list[tuple[str, str]]:
    """The metadata directories of ``wanted`` among ``names`` (a listing of ``directory``): (path, metadata file)."""
    found = []
    for entry in names:
        if entry[:1].lower() != wanted[0]:
            continue  # most entries of a big environment, passed over at once
        for suffix, metadata in ((".dist-info", "METADATA"), (".egg-info", "PKG-INFO")):
            if entry.endswith(suffix):
                stem = entry[: -len(suffix)]
                if canonical(stem.rpartition("-")[0] or stem) == wanted:
                    found.append((os.path.join(directory, entry), metadata))
    return sorted(found)


def read_dist(path: str, metadata_name: str, wanted: str) -> DistInfo | None:
    """The distribution of the metadata directory ``path`` if its METADATA names ``wanted`` with a version; None
    where it has no METADATA or names another; Unreadable where METADATA is not what pip writes."""
    shown = f"{os.path.basename(path)}/{metadata_name}"
    try:
        data = read_file(os.path.join(path, metadata_name), METADATA_LIMIT, "a METADATA", shown)
    except FileNotFoundError:  # none, or a file named like a dist-info
        return None
    try:
        headers = metadata_headers(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise Unreadable(shown, f"is not UTF-8 (byte {exc.start})") from None
    except ValueError as exc:
        raise Unreadable(shown, f"has {exc}: it is not one pip writes") from None
    name, version = (headers.get("name") or [""])[0], (headers.get("version") or [""])[0]
    if canonical(name) != wanted or not version:
        return None
    return DistInfo(wanted, version, os.path.dirname(path), path, headers, data)


def find_dist(name: str, search_path, package: str | None = None, listed: dict | None = None) -> DistInfo | None:
    """The first distribution called ``name`` on ``search_path`` (import order), None where there is none.

    One directory can hold two dist-infos of one project (``pip install --target --upgrade`` leaves the old one
    behind): the one whose RECORD matches more of the files of ``package`` (default: the name) on disk is the
    installed one; where both match as well, nothing tells them apart: Unreadable. ``listed``: directory listings
    made already (directory -> names), kept for the next search.
    """
    wanted = canonical(name)
    listed = {} if listed is None else listed
    for entry in dict.fromkeys(str(p) for p in search_path):
        names = listed.get(entry)
        if names is None:
            try:
                names = listed[entry] = os.listdir(entry)
            except OSError:
                names = listed[entry] = []
        found = [d for path, meta in _metadata_dirs(entry, wanted, names) if (d := read_dist(path, meta, wanted))]
        if len(found) == 1:
            return found[0]
        if found:
            return _installed_one(found, package or wanted.replace("-", "_"), entry)
    return None


def _installed_one(found: list[DistInfo], package: str, directory: str) -> DistInfo:
    """Of several dist-infos of one project in ``directory``, the one whose RECORD matches the package on disk."""
    scored = sorted(((_matching_modules(d, package), n, d) for n, d in enumerate(found)), key=lambda x: (-x[0], x[1]))
    if scored[0][0] == scored[1][0]:
        both = " and ".join(d.version for _, _, d in scored[:2])
        why = f"two {found[0].name} dist-infos ({both}) match the files on disk equally well"
        raise Ambiguous(
            directory,
            why,
            f"two {found[0].name} dist-infos in {directory} ({both}) match the files on disk equally well",
        )
    return scored[0][2]


def _matching_modules(dist: DistInfo, package: str) -> int:
    """How many of the package's top-level modules on disk are the ones this RECORD lists (-1: no RECORD)."""
    try:
        record = dist.record()
    except Unreadable:
        return -1
    matches = 0
    for rel, digest in record.items():
        if rel.startswith(package + "/") and rel.count("/") == 1 and rel.endswith(".py"):
            try:
                data = read_file(os.path.join(dist.root, rel), SOURCE_LIMIT)
            except (OSError, Unreadable):
                continue
            matches += record_digest(data) == digest
    return matches


def read_record(dist_info: str, prefix: str = "", within: str = "") -> dict[str, tuple[str, str, str]]:
    """A wheel's RECORD (CSV: path, ``algorithm=digest``, size) as path -> (algorithm, digest, size), the hash and
    size empty where RECORD gives none; with ``prefix`` and ``within``, only the lines that begin with the one and
    hold the other (each line as written). Unreadable where it is missing, not a regular file, over its limit, not
    UTF-8, or holds a line that is not one pip writes (naming the line)."""
    shown = f"{os.path.basename(dist_info)}/RECORD"
    try:
        data = read_file(os.path.join(dist_info, "RECORD"), RECORD_LIMIT, "a RECORD", shown)
    except FileNotFoundError:
        raise Unreadable(shown, "is missing") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unreadable(shown, f"is not UTF-8 (byte {exc.start})") from None
    entries = {}
    for number, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")
        if not line or not line.startswith(prefix) or within not in line:
            continue
        row = _record_row(line)
        if row is None:
            raise Unreadable(shown, f"line {number} is not path,hash,size: {_shown(line)}")
        entries[row[0]] = row[1:]
    return entries


_HASH_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_="  # urlsafe base64


def _record_row(line: str) -> tuple[str, str, str, str] | None:
    """(path, algorithm, digest, size) of one RECORD line (csv's default dialect: a field may be quoted, ``""``
    within it a quote); None where it is not three fields of a path, ``algorithm=digest`` or nothing, and a size
    in digits or nothing."""
    if '"' not in line:
        fields = line.split(",")  # what pip writes for every path without a comma or a quote in it
    else:
        fields = _quoted_fields(line)
        if fields is None:
            return None
    if len(fields) != 3 or not fields[0]:
        return None
    path, hashed, size = fields
    algorithm, sep, digest = hashed.partition("=")
    if hashed and (not sep or not algorithm.isalnum() or not 0 < len(digest) <= 128 or digest.strip(_HASH_CHARS)):
        return None
    if size and not (size.isdigit() and len(size) <= 20):
        return None
    return path, algorithm, digest, size


def _quoted_fields(line: str) -> list[str] | None:
    """The fields of a CSV line with quoted fields; None where a quote is left open or text follows one."""
    fields, at = [], 0
    while True:
        if line.startswith('"', at):
            end, value = at + 1, []
            while True:
                close = line.find('"', end)
                if close < 0:
                    return None
                value.append(line[end:close])
                if line.startswith('"', close + 1):
                    value.append('"')
                    end = close + 2
                    continue
                at = close + 1
                break
            fields.append("".join(value))
            if at < len(line) and line[at] != ",":
                return None
        else:
            comma = line.find(",", at)
            fields.append(line[at : comma if comma >= 0 else len(line)])
            at = comma if comma >= 0 else len(line)
        if at >= len(line):
            return fields
        at += 1  # the comma


# -- FlashInfer's pin ------------------------------------------------------------------------
FLASHINFER = "flashinfer-python"
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_VERSION_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.+!_-")
_OPERATORS = ("===", "==", "!=", "<=", ">=", "~=", "<", ">")


def parse_requirement(text: str) -> tuple[str, list[tuple[str, str]], str] | None:
    """A PEP 508 requirement as (canonical name, [(operator, version)], marker text); None where it is none this
    reader can read (a URL requirement, an odd character): such a requirement pins nothing."""
    spec, _, marker = text.partition(";")
    spec = spec.strip()
    end = next((i for i, c in enumerate(spec) if c not in _NAME_CHARS), len(spec))
    name, rest = spec[:end], spec[end:].lstrip()
    if not name or not name[0].isalnum() or not name[-1].isalnum():
        return None
    if rest.startswith("["):  # extras: they change nothing of what is pinned
        close = rest.find("]")
        if close < 0:
            return None
        rest = rest[close + 1 :].lstrip()
    if rest.startswith("(") and rest.endswith(")"):
        rest = rest[1:-1].strip()
    clauses = []
    for clause in filter(None, (c.strip() for c in rest.split(","))) if rest else ():
        operator = next((op for op in _OPERATORS if clause.startswith(op)), None)
        version = clause[len(operator) :].strip() if operator else ""
        if operator is None or not version or not set(version) <= _VERSION_CHARS | {"*"}:
            return None
        clauses.append((operator, version))
    if rest and not clauses:
        return None
    return canonical(name), clauses, marker.strip()


def marker_holds(marker: str) -> bool | None:
    """Whether an environment marker holds here, for a requirement of no extra (packaging evaluates it; imported
    only where a requirement has a marker); None where the marker is not one."""
    from packaging.markers import InvalidMarker, Marker

    try:
        return bool(Marker(marker).evaluate({"extra": ""}))
    except InvalidMarker:
        return None


def flashinfer_pin(requirements) -> str | None:
    """The FlashInfer release a requirement list pins (``flashinfer-python==X``, X exact, with no extra asked for
    and its marker holding here); None where it pins none."""
    for text in requirements:
        if text.lstrip()[:10].lower() != "flashinfer":
            continue  # another project (the name leads; its spellings differ only after these letters)
        parsed = parse_requirement(text)
        if parsed is None or parsed[0] != FLASHINFER:
            continue
        _, clauses, marker = parsed
        if marker and not marker_holds(marker):
            continue
        if len(clauses) == 1 and clauses[0][0] == "==" and "*" not in clauses[0][1]:
            return clauses[0][1]
    return None
