"""The fast path: are the recorded verdicts still true here? Hashes only, no judging.

Shared by ``verify`` on an applied tree and by the serve guard, which runs in
every vLLM process: it imports nothing heavy (no libcst, Typer, rich,
importlib.metadata or packaging), reads the tree and the state with
:mod:`patch_dsv4.tree.installed` (the reader the engine uses too), and answers
None whenever it cannot vouch for the recorded verdicts; the caller then judges
the tree in full. A state or a dist-info that is malformed or oversized raises
:class:`~patch_dsv4.tree.installed.Unreadable`: one line naming the file, never
a pass.

Recorded verdicts stand only if they were made by these patch definitions (a
digest of the patch and engine sources; installed from a wheel, their sha256
as RECORD gives them), for this vLLM and FlashInfer, from files that all hash
as they did, on a build that is a release recorded in anchors/ and whose
needed edits (per that record) are exactly the files the state says we wrote.

Every file vouched for is read and hashed in this run: no file attribute
stands for its bytes (a write through a shared mmap may move neither mtime nor
ctime). On vLLM 0.30.0 that is 33 files, 0.9 MB: about 1 ms.
"""

import os
import posixpath
import sys

from patch_dsv4.tree.installed import (
    FLASHINFER,
    LOCK_FILE,  # noqa: F401 - the fast paths' names for the state's files
    MANIFEST,  # noqa: F401
    STATE_DIR,
    Unreadable,
    canonical,  # noqa: F401 - re-exported
    find_dist,
    flashinfer_pin,
    lock_holder,
    mount_table,
    mounts_below,
    parse_json,
    read_file,
    read_record,
    read_state,
    record_digest,
    sha256_file,
)
from patch_dsv4.tree.manifest_rules import READABLE_SCHEMAS, InvalidManifest, check_manifest


def quote(text: str) -> str:
    """A shell word, as shlex.quote gives it (ASCII ``[\\w@%+=:,./-]+`` left as it is), without shlex or a regular
    expression (compiling one costs a fresh process more than the rest of this)."""
    if text and all((c.isascii() and c.isalnum()) or c in "_@%+=:,./-" for c in text):
        return text
    return "'" + text.replace("'", "'\"'\"'") + "'"


class Site:
    """The installed vLLM (and FlashInfer) as the fast path sees it."""

    __slots__ = ("site_packages", "vllm_version", "flashinfer_version", "flashinfer_source", "dist_info", "metadata")

    def __init__(
        self,
        site_packages: str,
        vllm_version: str,
        flashinfer_version: str | None,
        flashinfer_source: str | None,
        dist_info: str | None = None,
        metadata: bytes | None = None,
    ) -> None:
        self.site_packages, self.vllm_version = site_packages, vllm_version
        self.flashinfer_version, self.flashinfer_source = flashinfer_version, flashinfer_source
        self.dist_info = dist_info  # vLLM's dist-info directory (its build: patch_dsv4.fastpath.serving.build_identity)
        self.metadata = metadata  # its METADATA's bytes, as read (None: read them there)


def site_of(env) -> Site:
    """The Site of a located environment (any object with the Environment's four attributes)."""
    from patch_dsv4.fastpath.serving import dist_info_of

    return Site(
        str(env.site_packages), env.vllm_version, env.flashinfer_version, env.flashinfer_source, dist_info_of(env)
    )


def locate(search_path: list[str]) -> Site | None:
    """vLLM and FlashInfer on ``search_path``, found as the engine finds them (patch_dsv4.tree.installed.find_dist);
    None where there is no vLLM; Unreadable where a dist-info is malformed or two tie."""
    listed: dict[str, list[str]] = {}
    vllm = find_dist("vllm", search_path, "vllm", listed)
    if vllm is None or not os.path.isdir(os.path.join(vllm.root, "vllm")):
        return None
    flashinfer = find_dist(FLASHINFER, [vllm.root, *search_path], "flashinfer", listed)
    if flashinfer is not None:
        return Site(vllm.root, vllm.version, flashinfer.version, "installed", vllm.path, vllm.metadata)
    pin = flashinfer_pin(vllm.requires())
    return Site(vllm.root, vllm.version, pin, "pinned" if pin else None, vllm.path, vllm.metadata)


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
    """The manifest, read without following a symlinked state directory or file; None where there is none;
    Unreadable where it is not a JSON object of at most MANIFEST_LIMIT bytes (patch_dsv4.tree.installed)."""
    data = read_state(site_packages)
    if data is not None and not isinstance(data, dict):
        raise Unreadable(MANIFEST, "is not a JSON object")
    return data


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
    """Who is writing this environment now (an apply or revert holding its lock), or None; never waits."""
    return lock_holder(site_packages)


class Hasher:
    """sha256 of the package's files, each read and hashed once per run (regular files only, links followed)."""

    def __init__(self, site_packages: str) -> None:
        self.site = site_packages
        self._prefix = os.path.join(site_packages, "")  # + a relative path: os.path.join's, a tenth of its time
        self._cache: dict[str, str | None] = {}

    def __call__(self, relpath: str) -> str | None:
        if relpath not in self._cache:
            self._cache[relpath] = sha256_file(self._prefix + relpath)
        return self._cache[relpath]


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
    import hashlib

    from patch_dsv4 import __version__

    root = _subpackage_dir("")
    site = os.path.dirname(root) + os.sep
    installed = _installed_hashes(os.path.join(site, f"{os.path.basename(root)}-{__version__}.dist-info"))
    digest = hashlib.sha256(__version__.encode())
    for directory in (root, _subpackage_dir("patches")):
        prefix = os.path.join(directory, "")
        for name in _sources(directory):
            path = prefix + name  # POSIX: name's "/" is the separator
            sha = _recorded_sha(installed, path[len(site) :].replace(os.sep, "/"), path) if installed else None
            if sha is None:
                sha = record_digest(read_file(path, 32 << 20))
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


def _installed_hashes(dist_info: str) -> tuple[dict, int] | None:
    """A wheel's RECORD (path -> (algorithm, digest, size)) and RECORD's mtime; None without a readable one (an
    editable install, a package not installed from a wheel): the files are read then."""
    try:
        written = os.stat(os.path.join(dist_info, "RECORD")).st_mtime_ns
        return read_record(dist_info, "patch_dsv4/", ".py,"), written  # the package's sources: what it reads
    except (OSError, Unreadable):
        return None


def _recorded_sha(installed: tuple[dict, int], rel: str, path: str) -> str | None:
    """The sha256 RECORD gives for ``rel`` (its text) if the file at ``path`` has RECORD's size for it and was not
    modified after RECORD was written; None otherwise (the file is read)."""
    entries, written = installed
    algorithm, sha, size = entries.get(rel, ("", "", ""))
    if algorithm != "sha256" or len(sha) != 43 or not size.isdigit():
        return None  # not listed, or another hash: read as any other file (read_record checked its characters)
    try:
        st = os.stat(path)
    except OSError:
        return None
    return sha if st.st_size == int(size) and st.st_mtime_ns <= written else None


def anchors_record(vllm_version: str) -> dict | None:
    """anchors/vllm-<version>.json, None when this release is not recorded (or the record is unreadable)."""
    path = os.path.join(_subpackage_dir("anchors"), f"vllm-{vllm_version}.json")
    try:
        record = parse_json(read_file(path, 16 << 20), path)
    except (OSError, Unreadable):
        return None
    return record if isinstance(record, dict) else None


def _check_well_formed(manifest: dict, record: dict) -> None:
    """The state's own rules (patch_dsv4.tree.manifest_rules), with the record's patches standing for the patch
    definitions (the patch digest says they are the same): a manifest the full path calls unreadable is refused
    here too, in the same words (Unreadable)."""
    declared = {a["file"] for entry in record["patches"].values() for a in entry.get("anchors", [])}
    try:
        check_manifest(manifest, declared, record["patches"])
    except InvalidManifest as exc:
        raise Unreadable(MANIFEST, str(exc), f"{MANIFEST}: {exc}") from None
    except RecursionError:
        raise Unreadable(MANIFEST, "is nested too deeply") from None


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
    """The manifest's recorded verdicts when nothing they were based on has changed; else None. Unreadable where
    the manifest is malformed (patch_dsv4.tree.installed.read_state, then the state's rules)."""
    if write_in_progress(site.site_packages):
        return None  # a write under way: the caller waits for it (or, the guard, reports it)
    manifest = read_manifest(site.site_packages) if manifest is None else manifest
    hasher = hasher or Hasher(site.site_packages)
    try:
        if manifest.get("transaction") is not None or manifest.get("vllm_version") != site.vllm_version:
            return None  # a write to finish, or a stale state: the full path says which
        if manifest.get("patch_digest") != patch_digest():
            return None  # other definitions wrote it: judged in full (by the rules of these)
        record = anchors_record(site.vllm_version)
        if record is None:
            return None
        _check_well_formed(manifest, record)  # by these definitions' rules: refused as the full path refuses it
        verdicts, files, inputs = manifest["verdicts"], manifest["files"], manifest["inputs"]
        if manifest.get("schema") not in READABLE_SCHEMAS or not verdicts:
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
        if not same_flashinfer(record, manifest["flashinfer"]["version"]):
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
    opt-in in ``asked``; None where verify judges in full. Unreadable where the state is malformed."""
    recorded = recorded_verdicts(site)
    if recorded is None or not set(asked) <= set(recorded.opt_in):
        return None
    ours = {f for v in recorded.verdicts.values() if v["verdict"] == "applied" for f in v["files"]}
    if _mounted(site.site_packages, sorted(ours)):
        return None  # another tool's mount over a file we wrote: verify in full says so (a note), revert refuses it
    return recorded


def _mounted(site_packages: str, relpaths: list[str]) -> bool:
    """Whether a file of ``relpaths`` lies on another mount than site-packages (patch_dsv4.tree.mounts.mounted): the
    whole table is read, and parsed (mounts imported) only where it may hold a mount point below site-packages or a
    file is reached through a link."""
    table = mount_table()
    if not table:
        return False  # no table: nothing is mounted (mounts.read_mounts)
    site = os.path.join(os.path.realpath(site_packages), "")
    inside = all(os.path.realpath(os.path.join(site_packages, rel)).startswith(site) for rel in relpaths)
    if inside and not mounts_below(site_packages, table):
        return False
    from patch_dsv4.tree import mounts

    return bool(mounts.mounted(site_packages, [STATE_DIR, *relpaths], mounts.parse(table)))


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
    there is a state, the anchors' record on a pristine known build; None when the hashes cannot vouch (or the
    state cannot be read: the full judgement says why)."""
    try:
        known = known_judgement(site)
    except Unreadable:
        return None
    return known.verdicts if known is not None else None


def known_judgement(site: Site) -> Recorded | None:
    """:func:`known_verdicts` with the files they were judged from and the opt-ins asked for (what the
    fingerprint of :mod:`patch_dsv4.fastpath.serving` is made of); None when the hashes cannot vouch; Unreadable
    where the state is malformed."""
    hasher = Hasher(site.site_packages)
    manifest = read_manifest(site.site_packages)
    if manifest is None:
        record = anchors_record(site.vllm_version)
        verdicts = anchored_verdicts(site, hasher, record) if record is not None else None
        return None if verdicts is None else Recorded(verdicts, "", (), dict(record["files"]))
    return recorded_verdicts(site, manifest, hasher)


def recorded_document(
    site: Site, recorded: Recorded, target_args: str = "", served=None, hooks=(), fingerprint: bool = True
) -> dict:
    """The verify document of recorded verdicts (the document the full judgement gives), without the typed model.

    ``served``: their fingerprint (patch_dsv4.fastpath.serving.of_recorded), when the caller has it already;
    ``hooks``: the start-up hooks that name vLLM (patch_dsv4.tree.hooks.find_hooks), each a note;
    ``fingerprint``: False where no one reads it (a plain table): not made, None in the document.
    """
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
        fingerprint=(served or _of_recorded(site, recorded)).text if fingerprint else None,
        notes=[hook.note(site.site_packages) for hook in hooks],
        hooks=[hook.to_json() for hook in hooks],
    )


def _of_recorded(site: Site, recorded: Recorded):
    from patch_dsv4.fastpath.serving import of_recorded  # where a fingerprint is made: a plain table makes none

    return of_recorded(site, recorded)


def _needs_action_exit() -> int:
    from patch_dsv4.output.errors import EXIT_NEEDS_ACTION  # imported where a patch needs action, only

    return EXIT_NEEDS_ACTION


def recorded_report(site: Site, recorded: Recorded, target_args: str = "", hooks=(), served=None):
    """The verify report of recorded verdicts, typed: :func:`recorded_document` as a verdicts.Report."""
    from patch_dsv4.output.verdicts import Report

    return Report.from_json(recorded_document(site, recorded, target_args, served, hooks))
