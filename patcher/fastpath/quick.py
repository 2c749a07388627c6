"""The fast path: are the recorded verdicts still true here? Hashes only, no judging.

Shared by ``verify`` on an applied tree and by the serve guard, which runs in
every vLLM process: it imports nothing heavy (no libcst, Typer, rich,
importlib.metadata or packaging, and, for a cold interpreter's sake, neither
re nor json), reads the dist-info files directly, and answers None whenever it
cannot vouch for the recorded verdicts; the caller then judges the tree in
full.

Recorded verdicts stand only if they were made by these patch definitions (a
digest of the patch and engine sources; installed from a wheel, their sha256
as RECORD gives them), for this vLLM and FlashInfer, from
files that all hash as they did, on a build that is a release recorded in
anchors/ and whose needed edits (per that record) are exactly the files the
state says we wrote.

A file is read and hashed only where the state's stat keys do not vouch for it
(:data:`STAT_KEYS`): apply records, beside the sha256 it read, each file's
device, inode, size, mtime and ctime, once the file system's clock has moved
on from the file's last change; the same key found again means the file was
not written since. A copied or reinstalled tree, a state without keys, or any
file changed in any way is read and hashed as before.
"""

import os
import posixpath
import stat
import sys

# The interpreter's own SHA-256 for the short texts hashed on every run (the patch digest): loading OpenSSL's library
# (_hashlib) takes a cold interpreter about 3 ms, so it is loaded only where a file must be read (file_sha256).
try:  # by name: a module looked for and not found costs a search of every sys.path entry
    if "_hashlib" in sys.modules:  # OpenSSL's, loaded already (vLLM has, before it calls its plugins)
        from _hashlib import openssl_sha256 as sha256
    elif sys.version_info >= (3, 12):
        from _sha2 import sha256
    else:
        from _sha256 import sha256
except ImportError:  # an interpreter built without its own hashes
    from hashlib import sha256

from patch_dsv4.tree.manifest_rules import READABLE_SCHEMAS, InvalidManifest, check_manifest

STATE_DIR = ".patch-dsv4"
MANIFEST = "manifest.json"
LOCK_FILE = ".patch-dsv4.lock"  # patch_dsv4.tree.state takes it; the fast paths only look
_SOURCE_LIMIT = 32 << 20


# -- JSON without the json package --------------------------------------------------------
# Importing json costs a cold interpreter about 1 ms (its decoder and encoder compile regular expressions at import);
# the fast paths read two small documents, so they call the C scanner json.decoder itself uses, and import json only
# where it is missing (patch_dsv4.fastpath.serving.dumps writes the fingerprint's canonical text the same way).
class _Strict:
    """What json's C scanner reads from its context: json.loads's defaults."""

    strict, object_hook, object_pairs_hook = True, None, None
    parse_float, parse_int = float, int

    @staticmethod
    def parse_constant(name: str) -> float:
        return float(name.replace("Infinity", "inf"))  # NaN, Infinity, -Infinity, as json.loads reads them


_WHITESPACE = " \t\n\r"  # json's WHITESPACE


def loads(data: bytes):
    """json.loads(data): the same values, and json's own ValueError for data that is not one UTF-8 JSON document."""
    try:
        from _json import make_scanner

        text = data.decode("utf-8")
        value, end = make_scanner(_Strict)(text, len(text) - len(text.lstrip(_WHITESPACE)))
        if not text[end:].strip(_WHITESPACE) and not text.startswith("\ufeff"):
            return value
    except (ImportError, UnicodeDecodeError, StopIteration):
        pass
    import json  # no C scanner, another encoding, or no document: json says what it makes of it

    return json.loads(data)


def quote(text: str) -> str:
    """A shell word (shlex.quote, without importing shlex for it)."""
    import re  # verify's messages only: re costs a bare interpreter about 6 ms, and the guard needs none of it

    if text and re.fullmatch(r"[\w@%+=:,./-]+", text):
        return text
    return "'" + text.replace("'", "'\"'\"'") + "'"


def canonical(name: str) -> str:
    """The normalised name of a distribution (PEP 503: each run of ``-_.`` one ``-``, lower case), without re."""
    name = name.lower().replace("_", "-").replace(".", "-")
    while "--" in name:
        name = name.replace("--", "-")
    return name


class DistInfo:
    """A distribution found on the search path (a plain class: the guard builds no dataclass at import)."""

    __slots__ = ("name", "version", "root", "metadata", "path")

    def __init__(self, name: str, version: str, root: str, metadata: str, path: str | None = None) -> None:
        self.name, self.version, self.metadata = name, version, metadata
        self.root = root  # the directory holding the dist-info (and the package)
        self.path = path  # the dist-info directory


def _metadata_headers(text: str, first: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The headers of a METADATA text (lower-case name -> values); with ``first``, read only until each of those
    names has a value (Name and Version lead every METADATA: its hundred Requires-Dist lines are not read)."""
    headers: dict[str, list[str]] = {}
    for line in text.partition("\n\n")[0].splitlines():  # the description after the headers: not split
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and not line[0].isspace():
            headers.setdefault(key.strip().lower(), []).append(value.strip())
            if first and all(name in headers for name in first):
                break
    return headers


def read_regular(path: str, limit: int) -> bytes:
    """The first ``limit`` bytes of a regular file; OSError for anything else (a FIFO or device never blocks)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        chunks, left = [], limit
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def find_dist(name: str, search_path: list[str], listed: dict | None = None) -> DistInfo | None | bool:
    """The first dist-info of ``name`` on ``search_path``; False when a directory holds several (ambiguous).

    ``listed``: the names of directories listed already (directory -> names), kept for the next search; a
    directory that comes again in ``search_path`` is not looked at again (it held no ``name``).
    """
    wanted = canonical(name)
    listed = {} if listed is None else listed
    seen = set()
    for entry in search_path:
        if entry in seen:
            continue
        seen.add(entry)
        names = listed.get(entry)
        if names is None:
            try:
                names = listed[entry] = os.listdir(entry)
            except OSError:
                listed[entry] = []
                continue
        found = []
        for dist_info in names:
            if dist_info[:1].lower() != wanted[0] or not dist_info.endswith(".dist-info"):
                continue  # most entries of a big environment, passed over without a regex
            if canonical(dist_info[: -len(".dist-info")].rpartition("-")[0]) == wanted:
                try:
                    text = read_regular(os.path.join(entry, dist_info, "METADATA"), 1 << 20).decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    return False
                headers = _metadata_headers(text, ("name", "version"))
                if canonical((headers.get("name") or [""])[0]) == wanted and headers.get("version"):
                    path = os.path.join(entry, dist_info)
                    found.append(DistInfo(wanted, headers["version"][0], entry, text, path))
        if len(found) == 1:
            return found[0]
        if found:
            return False
    return None


_VERSION_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.+!_-")


def _pinned_version(spec: str) -> str | None:
    """X of ``flashinfer-python==X`` (``_`` or ``.`` for ``-``, any case, ``(== X)``, blanks around), else None: the
    pattern ``^flashinfer[-_.]python\\s*\\(?\\s*==\\s*([A-Za-z0-9.+!_-]+)\\s*\\)?\\s*$`` (re.I), read without
    re (about 6 ms in a bare interpreter)."""
    spec = spec.strip()
    if spec[:10].lower() != "flashinfer" or spec[10:11] not in ("-", "_", ".") or spec[11:17].lower() != "python":
        return None
    rest = spec[17:].lstrip()
    rest = rest[1:].lstrip() if rest.startswith("(") else rest
    if not rest.startswith("=="):
        return None
    rest = rest[2:].lstrip()
    end = next((i for i, c in enumerate(rest) if c not in _VERSION_CHARS), len(rest))
    version, rest = rest[:end], rest[end:].lstrip()
    rest = rest[1:].lstrip() if rest.startswith(")") else rest
    return version if version and not rest else None


def pinned_flashinfer(metadata: str) -> str | None | bool:
    """vLLM's ``flashinfer-python==X`` pin; False when the pin has a marker this reader will not judge."""
    for requirement in _metadata_headers(metadata).get("requires-dist", []):
        spec, _, marker = requirement.partition(";")
        if not canonical(spec.split("=")[0].split("(")[0].strip()).startswith("flashinfer-python"):
            continue
        found = _pinned_version(spec)
        if found is None:
            return False
        if marker.strip():
            return False
        return found
    return None


class Site:
    """The installed vLLM (and FlashInfer) as the fast path sees it."""

    __slots__ = ("site_packages", "vllm_version", "flashinfer_version", "flashinfer_source", "dist_info")

    def __init__(
        self,
        site_packages: str,
        vllm_version: str,
        flashinfer_version: str | None,
        flashinfer_source: str | None,
        dist_info: str | None = None,
    ) -> None:
        self.site_packages, self.vllm_version = site_packages, vllm_version
        self.flashinfer_version, self.flashinfer_source = flashinfer_version, flashinfer_source
        self.dist_info = dist_info  # vLLM's dist-info directory (its build: patch_dsv4.fastpath.serving.build_identity)


def site_of(env) -> Site:
    """The Site of a located environment (any object with the Environment's four attributes)."""
    from patch_dsv4.fastpath.serving import dist_info_of

    return Site(
        str(env.site_packages), env.vllm_version, env.flashinfer_version, env.flashinfer_source, dist_info_of(env)
    )


def locate(search_path: list[str]) -> Site | None:
    """vLLM and FlashInfer on ``search_path``, read from dist-info files; None when anything is unusual."""
    listed: dict[str, list[str]] = {}
    vllm = find_dist("vllm", search_path, listed)
    if not vllm or not os.path.isdir(os.path.join(vllm.root, "vllm")):
        return None
    flashinfer = find_dist("flashinfer-python", [vllm.root, *search_path], listed)
    if flashinfer is False:
        return None
    if flashinfer is not None:
        return Site(vllm.root, vllm.version, flashinfer.version, "installed", vllm.path)
    pin = pinned_flashinfer(vllm.metadata)
    if pin is False:
        return None
    return Site(vllm.root, vllm.version, pin, "pinned" if pin else None, vllm.path)


# -- reading without following links where the state is concerned ------------------------
def _is_source_relpath(rel: object) -> bool:
    if not isinstance(rel, str) or "\0" in rel or "\\" in rel or rel.startswith("/"):
        return False
    parts = rel.split("/")
    return (
        posixpath.normpath(rel) == rel
        and parts[0] == "vllm"
        and rel.endswith(".py")
        and not ({"", ".", ".."} & set(parts))
    )


def read_manifest(site_packages: str) -> dict | None:
    """The manifest as JSON, read without following a symlinked state directory or file; None otherwise."""
    return _read_state_json(site_packages, MANIFEST)


def _read_state_json(site_packages: str, name: str) -> dict | None:
    """A JSON object of the state directory, read without following a symlinked state directory or file; None
    where there is none, or it is not a regular file holding one JSON object."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        state = os.open(os.path.join(site_packages, STATE_DIR), flags | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=state)
    except OSError:
        return None
    finally:
        os.close(state)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        chunks, left = [], 64 << 20
        while left > 0 and (chunk := os.read(fd, min(left, max(st.st_size + 1, 1 << 16)))):
            chunks.append(chunk)
            left -= len(chunk)
        data = loads(b"".join(chunks))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else None


#: The package whose file set a record lists: a file added or removed there makes another build.
PACKAGE_DIR = "vllm/models/deepseek_v4"
#: The model packages whose file sets a record lists: DeepSeek-V4, and V4.1 in its release and nightly layouts.
PACKAGE_DIRS = (PACKAGE_DIR, "vllm/models/deepseek_v41", "vllm/models/deepseek_v4_1")


def package_files(names) -> list[str]:
    """The Python files of the DeepSeek-V4 and V4.1 packages among ``names`` (relative paths), sorted."""
    found = []
    for package in PACKAGE_DIRS:
        prefix = package + "/"
        found += [
            n
            for n in names
            if n.startswith(prefix) and n.endswith(".py") and "/__pycache__/" not in n[len(prefix) - 1 :]
        ]
    return sorted(found)


def listed_package_files(site) -> list[str]:
    """The Python files of the DeepSeek-V4 and V4.1 packages under ``site`` as they are on disk (links not followed)."""
    found: list[str] = []
    for package in PACKAGE_DIRS:
        _python_files(os.path.join(str(site), package), package, found)
    return package_files(found)


def _python_files(directory: str, rel: str, found: list[str]) -> None:
    """The ``.py`` names under ``directory`` (``rel`` relative to the site) into ``found``: what os.walk lists,
    __pycache__ and directory links not entered, in a third of its time (one scandir per directory)."""
    try:
        with os.scandir(directory) as entries:
            listed = list(entries)
    except OSError:
        return
    for entry in listed:
        try:
            is_dir = entry.is_dir()  # a link to a directory counts as one, as os.walk counts it
        except OSError:
            is_dir = False
        if not is_dir:
            if entry.name.endswith(".py"):
                found.append(f"{rel}/{entry.name}")
        elif entry.name != "__pycache__" and not entry.is_symlink():
            _python_files(entry.path, f"{rel}/{entry.name}", found)


def file_set_change(record: dict, files) -> str | None:
    """How ``files`` differ from the package files the record lists (None: the same, or nothing to compare)."""
    recorded = record.get("package_files")
    if files is None or not isinstance(recorded, list):
        return None
    now, then = set(files), set(recorded)
    if now == then:
        return None
    added, removed = sorted(now - then), sorted(then - now)
    parts = [f"{added[0]} added" + (f" (and {len(added) - 1} more)" if len(added) > 1 else "")] if added else []
    if removed:
        parts.append(f"{removed[0]} removed" + (f" (and {len(removed) - 1} more)" if len(removed) > 1 else ""))
    return ", ".join(parts)


def write_in_progress(site_packages: str) -> str | None:
    """Who is writing this environment now (an apply or revert holding its lock), or None; never waits.

    The lock file is opened only if it exists, read-only, without following a link; a FIFO never blocks.
    """
    try:
        fd = os.open(os.path.join(site_packages, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file: every command removes it when it ends
    try:
        import fcntl

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
            return holder or "another patch-dsv4 process"
        return None
    finally:
        os.close(fd)


# -- the files' sha256, vouched for by their stat keys where apply recorded them -------------
#: In the state directory beside the manifest: what apply found each file it judged from to be, as a stat key and
#: the sha256 read with it. Made by :func:`stat_keys`; a state without one (before 2026-12) has every file hashed.
STAT_KEYS = "stat-keys.json"
STAT_KEYS_FORMAT = 1
#: A key is recorded only if the file's last change (ctime) lies at least this long before a time stamp the same
#: file system gave a file of the state before the file was read (:func:`stat_keys`).
SETTLED_NS = 20_000_000


def file_sha256():
    """The sha256 constructor to hash files with: OpenSSL's (about 4 times as fast as the interpreter's, but 3 ms to
    load), loaded on the first file this run must read."""
    try:
        from _hashlib import openssl_sha256

        return openssl_sha256
    except ImportError:
        from hashlib import sha256 as hashlib_sha256

        return hashlib_sha256


def stat_key(st) -> tuple[int, int, int, int, int]:
    """What a file's status says of its content: the same file (device, inode), its size, when its data was last
    written (mtime, which anyone may set back) and when the file last changed (ctime, which no one can set: any
    write, rename, chmod or utime moves it to the file system's clock at that moment)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _is_int(value) -> bool:
    return type(value) is int


def read_stat_keys(site_packages: str) -> dict[str, tuple[tuple, str]]:
    """The state's stat keys, path -> (stat key, sha256); {} where there are none, and without any entry that is
    not exactly what :func:`stat_keys` writes (any doubt: the file is read and hashed)."""
    data = _read_state_json(site_packages, STAT_KEYS)
    files = data.get("files") if data is not None and data.get("format") == STAT_KEYS_FORMAT else None
    if not isinstance(files, dict):
        return {}
    keys = {}
    for rel, entry in files.items():
        if (
            isinstance(entry, list)
            and len(entry) == 6
            and all(map(_is_int, entry[:5]))
            and isinstance(entry[5], str)
            and len(entry[5]) == 64
            and not entry[5].strip("0123456789abcdef")
        ):
            keys[rel] = (tuple(entry[:5]), entry[5])
    return keys


class Hasher:
    """sha256 of the package's files, each read once per run (regular files only, links followed).

    A file whose stat key is the one the state recorded (:data:`STAT_KEYS`) has the sha256 recorded with it, and is
    not read: its ctime is that of when apply read it, and nothing can have written it since without moving it.
    """

    def __init__(self, site_packages: str) -> None:
        self.site = site_packages
        self._prefix = os.path.join(site_packages, "")  # + a relative path: os.path.join's, a tenth of its time
        self._cache: dict[str, str | None] = {}
        self._keys: dict[str, tuple[tuple, str]] | None = None  # read on the first file asked for

    def __call__(self, relpath: str) -> str | None:
        if relpath not in self._cache:
            self._cache[relpath] = self._vouched(relpath) or self._hash(relpath)
        return self._cache[relpath]

    def _vouched(self, relpath: str) -> str | None:
        """The recorded sha256 of ``relpath`` if the file's stat key is the recorded one; None otherwise."""
        if self._keys is None:
            self._keys = read_stat_keys(self.site)
        recorded = self._keys.get(relpath)
        if recorded is None:
            return None
        try:
            st = os.stat(self._prefix + relpath)
        except OSError:
            return None
        return recorded[1] if stat.S_ISREG(st.st_mode) and stat_key(st) == recorded[0] else None

    def _hash(self, relpath: str) -> str | None:
        return _hash_file(self._prefix + relpath)[0]


def _hash_file(path: str) -> tuple[str | None, object]:
    """The sha256 of a regular file at ``path`` (links followed) and its status as read; (None, None) when it is
    absent, not a regular file, too big, or cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None, None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _SOURCE_LIMIT:
            return None, None
        digest = file_sha256()()
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
        return digest.hexdigest(), st
    except OSError:
        return None, None
    finally:
        os.close(fd)


def keyed_files(manifest: dict, record: dict | None) -> list[str]:
    """The files the fast path hashes on a state: those the manifest says apply wrote and judged from, and those
    the release's record lists (:func:`recorded_verdicts`)."""
    found = set(manifest.get("files") or ()) | set(manifest.get("inputs") or ())
    if record is not None:
        found |= set(record.get("files") or ())
    return sorted(rel for rel in found if _is_source_relpath(rel))


#: File systems whose ctime the kernel serving this process keeps itself, so that no write passes unseen: not a
#: network file system (a client caches another's attributes), nor FUSE (its ctime is whatever a process says).
KEYED_FILE_SYSTEMS = frozenset(("ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "bcachefs"))


def keyable(path: str) -> bool:
    """Whether ``path`` lies on a file system of :data:`KEYED_FILE_SYSTEMS` (the mount table's last, deepest mount
    holding it); False where the table cannot say."""
    from patch_dsv4.tree import mounts

    real = os.path.realpath(path)
    found = None
    for mount in mounts.read_mounts():
        point = mount.mount_point
        if (real == point or real.startswith(point.rstrip("/") + "/")) and (
            found is None or len(point) >= len(found.mount_point)
        ):
            found = mount
    return found is not None and found.fstype in KEYED_FILE_SYSTEMS


def changed_ns(site_packages: str, relpath: str) -> int:
    """When the file ``relpath`` last changed (its ctime, links followed); 0 where it is absent."""
    try:
        return os.stat(os.path.join(site_packages, relpath)).st_ctime_ns
    except OSError:
        return 0


def stat_keys(site_packages: str, relpaths, reference) -> dict[str, list]:
    """The stat keys to record, with the sha256 read, of the files ``relpaths`` (of ``site_packages``).

    ``reference`` is the status of a file the state directory holds, written (and its status taken) before any of
    these files is read: its ctime is the file system's clock then. A file is keyed only where

    - it is a regular file on the reference's file system (one clock),
    - its ctime lies :data:`SETTLED_NS` or more before the reference's: any write from then on, however soon, sets
      a later ctime, so a file whose key is found again later was not written after this read,
    - its status is the same before it is opened, as read, and after (the path still names the file read).

    Any other file is left out: the fast path reads and hashes it.
    """
    keys = {}
    for rel in relpaths:
        path = os.path.join(site_packages, rel)
        try:
            before = os.stat(path)
        except OSError:
            continue
        if (
            not stat.S_ISREG(before.st_mode)
            or before.st_dev != reference.st_dev
            or before.st_ctime_ns + SETTLED_NS > reference.st_ctime_ns
        ):
            continue
        sha, read = _hash_file(path)
        try:
            after = os.stat(path)
        except OSError:
            continue
        if sha is not None and stat_key(before) == stat_key(read) == stat_key(after):
            keys[rel] = [*stat_key(before), sha]
    return keys


def patch_digest() -> str:
    """A hash of the patch definitions and of the engine that judges them: of each source file's path and sha256
    (the package's modules, its subpackages' but doctor/'s, and patches/).

    verify's fast path and the guard trust recorded verdicts only if these
    made them; the package version does not change between commits. Installed
    from a wheel, a file's sha256 is the one the package's RECORD gives when
    the file has RECORD's size for it and was not modified after RECORD was
    written (else the file is read and hashed): the guard does not read its
    own sources in every vLLM process.
    """
    from patch_dsv4 import __version__

    root = _subpackage_dir("")
    site = os.path.dirname(root) + os.sep
    installed = _installed_hashes(os.path.join(site, f"{os.path.basename(root)}-{__version__}.dist-info", "RECORD"))
    digest = sha256(__version__.encode())
    for directory in (root, _subpackage_dir("patches")):
        prefix = os.path.join(directory, "")
        for name in _sources(directory):
            path = prefix + name  # POSIX: name's "/" is the separator
            sha = _recorded_sha(installed, path[len(site) :].replace(os.sep, "/"), path) if installed else None
            if sha is None:
                with open(path, "rb") as fh:
                    sha = _record_form(file_sha256()(fh.read()).digest())
            digest.update(f"{name}\0{sha}\0".encode())
    return digest.hexdigest()


def _subpackage_dir(name: str) -> str:
    """The folder of ``patch_dsv4.<name>`` (``""``: of patch_dsv4). patches/ and anchors/ lie inside the package
    where a wheel installs them, found there without importing them (a module costs a cold interpreter 0.15 ms);
    elsewhere (an editable install maps them to the checkout's folders) where the import system finds them."""
    import patch_dsv4

    root = os.path.dirname(os.path.abspath(patch_dsv4.__file__))
    if not name:
        return root
    module = sys.modules.get(f"patch_dsv4.{name}")
    if module is None:
        folder = os.path.join(root, name)
        if os.path.isfile(os.path.join(folder, "__init__.py")):
            return folder  # where the import system would find it first: the package's own folder
        __import__(f"patch_dsv4.{name}")
        module = sys.modules[f"patch_dsv4.{name}"]
    return os.path.dirname(os.path.abspath(module.__file__))


#: Subpackages whose modules judge nothing: doctor/ (it reads a pack and a serving environment), and where a wheel
#: installs them inside the package, patches/ (hashed on its own) and anchors/ (data; the state records the release).
_NOT_JUDGING = ("doctor", "patches", "anchors")


def _sources(directory: str) -> list[str]:
    """The modules of a package folder and of its subpackages but _NOT_JUDGING, as sorted '/'-separated paths."""
    found = []
    for name in os.listdir(directory):
        if name.endswith(".py"):
            found.append(name)
        elif name not in _NOT_JUDGING and name[0] not in "._" and os.path.isfile(f"{directory}/{name}/__init__.py"):
            found += [f"{name}/{sub}" for sub in _sources(os.path.join(directory, name))]
    return sorted(found)


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"  # RECORD's: base64, URL-safe, unpadded


def _record_form(sha: bytes) -> str:
    """A sha256 as a wheel's RECORD writes it (43 characters of URL-safe base64), without importing base64."""
    number = int.from_bytes(sha, "big") << 2  # 256 bits, padded to 43 characters of 6 bits
    return "".join(_B64[(number >> (6 * (42 - i))) & 63] for i in range(43))


def _installed_hashes(record: str) -> tuple[dict, int] | None:
    """The lines of a wheel's RECORD (``path,sha256=...,size``) by path, and RECORD's mtime; None without one (an
    editable install, a package not installed from a wheel)."""
    try:
        with open(record, "rb") as fh:
            written = os.fstat(fh.fileno()).st_mtime_ns
            lines = fh.read(1 << 20).decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    return {line.partition(",")[0]: line for line in lines if ".py," in line}, written


def _recorded_sha(installed: tuple[dict, int], rel: str, path: str) -> str | None:
    """The sha256 RECORD gives for ``rel`` (its text) if the file at ``path`` has RECORD's size for it and was not
    modified after RECORD was written; None otherwise (the file is read)."""
    lines, written = installed
    _, _, entry = lines.get(rel, "").partition(",sha256=")
    sha, _, size = entry.partition(",")
    if len(sha) != 43 or sha.strip(_B64) or not size.isdigit():
        return None  # not listed, another hash, or a quoted path (a comma in it): read as any other file
    try:
        st = os.stat(path)
    except OSError:
        return None
    return sha if st.st_size == int(size) and st.st_mtime_ns <= written else None


def anchors_record(vllm_version: str) -> dict | None:
    """anchors/vllm-<version>.json, None when this release is not recorded (or the record is unreadable)."""
    path = os.path.join(_subpackage_dir("anchors"), f"vllm-{vllm_version}.json")
    try:
        with open(path, "rb") as fh:
            record = loads(fh.read())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _well_formed(manifest: dict, record: dict) -> bool:
    """The state's own rules (patch_dsv4.tree.manifest_rules), with the record's patches standing for the patch
    definitions: a manifest the full path would call unreadable is never vouched for here."""
    declared = {a["file"] for entry in record["patches"].values() for a in entry.get("anchors", [])}
    try:
        check_manifest(manifest, declared, record["patches"])
    except (InvalidManifest, RecursionError):
        return False
    return True


class Recorded:
    """The verdicts a state recorded, vouched for by the hashes: what verify reports and the guard checks."""

    __slots__ = ("verdicts", "build_detail", "opt_in", "files")

    def __init__(self, verdicts: dict, build_detail: str, opt_in: tuple[str, ...], files: dict | None = None) -> None:
        self.verdicts = verdicts  # patch id -> {"title", "verdict", "files", "detail", "edits"}
        self.build_detail, self.opt_in = build_detail, opt_in
        self.files = files or {}  # every file the judgement read -> its sha256 (as the hashes found it)


def same_flashinfer(record: dict, version: str | None) -> bool:
    """Whether an anchors record was judged with FlashInfer ``version``.

    Only the version counts: the records come from ``--no-deps`` trees, where
    FlashInfer is the pinned one, and a real install has that release installed.
    """
    recorded = record.get("flashinfer")
    return isinstance(recorded, dict) and recorded.get("version") == version


def recorded_verdicts(site: Site, manifest: dict | None = None, hasher: Hasher | None = None) -> Recorded | None:
    """The manifest's recorded verdicts when nothing they were based on has changed; else None."""
    if write_in_progress(site.site_packages):
        return None  # a write under way: the caller waits for it (or, the guard, reports it)
    manifest = read_manifest(site.site_packages) if manifest is None else manifest
    hasher = hasher or Hasher(site.site_packages)
    try:
        if manifest.get("schema") not in READABLE_SCHEMAS or manifest.get("transaction") is not None:
            return None
        if manifest.get("vllm_version") != site.vllm_version:
            return None
        verdicts, files, inputs = manifest["verdicts"], manifest["files"], manifest["inputs"]
        if not (isinstance(verdicts, dict) and verdicts and isinstance(files, dict) and isinstance(inputs, dict)):
            return None
        if manifest.get("patch_digest") != patch_digest():
            return None
        if manifest.get("flashinfer") != {"version": site.flashinfer_version, "source": site.flashinfer_source}:
            return None
        if not all(_is_source_relpath(rel) for rel in (*files, *inputs)):
            return None
        for relpath, entry in files.items():
            if hasher(relpath) != entry["after"]:
                return None
        for relpath, sha in inputs.items():
            if hasher(relpath) != sha:
                return None
        applied = {f for v in verdicts.values() if v["verdict"] == "applied" for f in v["files"]}
        if applied != set(files) or not set(files) <= set(inputs):
            return None
        record = anchors_record(site.vllm_version)
        if record is None or not same_flashinfer(record, manifest["flashinfer"]["version"]):
            return None
        if not _well_formed(manifest, record):
            return None
        for relpath, sha in record["files"].items():
            as_installed = files[relpath]["before"] if relpath in files else hasher(relpath)
            if as_installed != sha:
                return None
        if _file_set_changed(site, record):
            return None
        opt_in = tuple(manifest.get("opt_in", []))
        needed = {
            anchor["file"]
            for pid, entry in record["patches"].items()
            if pid in verdicts and (not entry.get("opt_in") or pid in opt_in)
            for anchor in entry.get("anchors", [])
            if anchor.get("verdict") == "pending"
        }
        if needed != set(files) or set(record["patches"]) != set(verdicts):
            return None
    except (KeyError, TypeError, AttributeError):
        return None
    record_name = f"anchors/vllm-{site.vllm_version}.json"
    detail = f"known build: vLLM {site.vllm_version} matches {record_name} ({len(record['files'])} files)"
    return Recorded(verdicts, detail, opt_in, dict(inputs))


def vouched(site: Site, asked) -> Recorded | None:
    """verify's fast path, the one: the recorded verdicts, when the hashes vouch for them and the state keeps every
    opt-in in ``asked``; None where verify judges in full."""
    recorded = recorded_verdicts(site)
    if recorded is None or not set(asked) <= set(recorded.opt_in):
        return None
    ours = {f for v in recorded.verdicts.values() if v["verdict"] == "applied" for f in v["files"]}
    if _mounted(site.site_packages, sorted(ours)):
        return None  # another tool's mount over a file we wrote: verify in full says so (a note), revert refuses it
    return recorded


def _mounted(site_packages: str, relpaths: list[str]) -> bool:
    """Whether a file of ``relpaths`` is mounted over (patch_dsv4.tree.mounts.mounted), the table parsed only where
    it names one of their real paths: a path without a blank or a backslash stands in it as it is."""
    from patch_dsv4.tree import mounts

    try:
        with open(mounts.MOUNTINFO, "rb") as fh:
            data = fh.read(mounts._LIMIT)
    except OSError:
        return False  # no table: nothing is mounted (mounts.read_mounts)
    for rel in relpaths:
        real = os.path.realpath(os.path.join(site_packages, rel))
        if any(c in real for c in " \t\n\\") or os.fsencode(real) in data:
            return bool(mounts.mounted(site_packages, relpaths, mounts.parse(data)))
    return False


def _file_set_changed(site: Site, record: dict) -> bool:
    """Whether the DeepSeek-V4 package holds other files than the record lists (another build)."""
    return file_set_change(record, listed_package_files(site.site_packages)) is not None


def _anchored_files(anchors: list) -> list[str]:
    """A patch's files, leaving out those it has no code path in where another of its files has one."""
    here = sorted({a["file"] for a in anchors if a.get("verdict") != "not-applicable"})
    return here or sorted({a["file"] for a in anchors})


def anchored_verdicts(site: Site, hasher: Hasher, record: dict | None = None) -> dict | None:
    """A pristine known build (no state): the verdicts anchors/ recorded for it, if its files hash as recorded."""
    record = anchors_record(site.vllm_version) if record is None else record
    if record is None or not same_flashinfer(record, site.flashinfer_version):
        return None
    try:
        if any(hasher(rel) != sha for rel, sha in record["files"].items()) or _file_set_changed(site, record):
            return None
        return {
            pid: {
                "verdict": "opt-in" if entry.get("opt_in") and entry["verdict"] == "pending" else entry["verdict"],
                "files": _anchored_files(entry.get("anchors", [])),
            }
            for pid, entry in record["patches"].items()
        }
    except (KeyError, TypeError, AttributeError):
        return None


def known_verdicts(site: Site) -> dict | None:
    """Each patch's {"verdict", "files", ...} decided from hashes alone: the state's recorded judgement when
    there is a state, the anchors' record on a pristine known build; None when the hashes cannot vouch."""
    known = known_judgement(site)
    return known.verdicts if known is not None else None


def known_judgement(site: Site) -> Recorded | None:
    """:func:`known_verdicts` with the files they were judged from and the opt-ins asked for (what the
    fingerprint of :mod:`patch_dsv4.fastpath.serving` is made of); None when the hashes cannot vouch."""
    hasher = Hasher(site.site_packages)
    manifest = read_manifest(site.site_packages)
    if manifest is None:
        record = anchors_record(site.vllm_version)
        verdicts = anchored_verdicts(site, hasher, record) if record is not None else None
        return None if verdicts is None else Recorded(verdicts, "", (), dict(record["files"]))
    return recorded_verdicts(site, manifest, hasher)


def recorded_document(site: Site, recorded: Recorded, target_args: str = "", served=None) -> dict:
    """The verify document of recorded verdicts (the document the full judgement gives), without the typed model.

    ``served``: their fingerprint (patch_dsv4.fastpath.serving.of_recorded), when the caller has it already.
    """
    from patch_dsv4.fastpath.serving import of_recorded
    from patch_dsv4.output.render import (
        NEEDS_ACTION,
        edit_document,
        next_command,
        patch_document,
        report_document,
        summary_text,
    )

    patches = [
        patch_document(
            pid,
            v["title"],
            v["verdict"],
            v["files"],
            v["detail"],
            [
                edit_document(
                    e["label"],
                    e["file"],
                    e["scope"],
                    e["verdict"],
                    e["detail"],
                    e.get("expected"),
                    e.get("found"),
                    e.get("foreign"),
                )
                for e in v.get("edits", [])
            ],
        )
        for pid, v in sorted(recorded.verdicts.items())
    ]
    bad = [p["verdict"] for p in patches if p["verdict"] in NEEDS_ACTION]
    return report_document(
        command="verify",
        exit_code=_needs_action_exit() if bad else 0,
        target=site.site_packages,
        vllm_version=site.vllm_version,
        flashinfer_version=site.flashinfer_version,
        flashinfer_source=site.flashinfer_source,
        build={"known": True, "detail": recorded.build_detail},
        state="current",
        patches=patches,
        summary=summary_text("verify", (p["verdict"] for p in patches), "hashes match the recorded state"),
        backups=os.path.join(site.site_packages, STATE_DIR, "backups"),
        next_step=next_command(target_args, bad),
        fingerprint=(served or of_recorded(site, recorded)).text,
    )


def _needs_action_exit() -> int:
    from patch_dsv4.output.errors import EXIT_NEEDS_ACTION  # imported where a patch needs action, only

    return EXIT_NEEDS_ACTION


def recorded_report(site: Site, recorded: Recorded, target_args: str = ""):
    """The verify report of recorded verdicts, typed: :func:`recorded_document` as a verdicts.Report."""
    from patch_dsv4.output.verdicts import Report

    return Report.from_json(recorded_document(site, recorded, target_args))
