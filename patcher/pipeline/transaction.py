"""Committing: a plan carried out as one write transaction, all files of one apply or revert changed or none.

An apply or a revert goes through three phases:

1. prepare: write what the change needs into the state directory (backups of
   the installed files, staged copies of the new ones) and prove that every
   target can be replaced: each target is writable and a temp file holding its
   new bytes fits beside it. Nothing in vLLM has changed yet; a failure here
   undoes what was prepared and leaves the tree and the state as they were.
2. the journal: the manifest is saved with the transaction in it (from/to
   hashes of every file), so that a killed run is finished by the next one.
3. commit: each target is replaced (temp file, fsync, rename; cached bytecode
   removed around it), then the manifest is saved without the journal. If a
   write still fails here, the files already replaced are put back from memory
   and the previous manifest is restored: the tree ends as it began.

Every failure (:class:`WriteFailed`, exit 2) names the file, the reason and the next step. An interrupt (Ctrl-C)
in the first two phases or in the commit undoes what was done, as a failure does, and says so (exit 130); one after
the commit says that the command completed.
"""

from __future__ import annotations

import copy
import os
import shlex
import stat
from dataclasses import dataclass

from patch_dsv4.output.errors import AGAIN, EnvironmentProblem, Interrupted, Refused, begun, completed
from patch_dsv4.pipeline.values import Committed, Plan, Rebuild, user_name
from patch_dsv4.tree.environment import Environment
from patch_dsv4.tree.fs import Dir, Owner, UnsafePath, checkpoint, sha256_bytes
from patch_dsv4.tree.state import STATE_DIR, Manifest, StateStore


class WriteFailed(EnvironmentProblem):
    """A write was refused or failed; the tree is as it was (or the message says how to finish)."""


def _os_reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _failure(action: str, rel: str, exc: Exception, undone: bool, env: Environment) -> WriteFailed:
    """A write that failed, said with its cause where it can be told (an immutable file, a read-only file system,
    a missing permission) and the command that removes it; then the same command again (patch_dsv4.cli names it)."""
    reason = exc.line() if isinstance(exc, EnvironmentProblem) else _os_reason(exc)
    where = env.site_packages / (rel if rel.startswith("vllm/") else STATE_DIR)
    cause, fix = _cause(where, exc) or (reason, "fix the cause")
    if undone:
        # a fix that is a command runs before the same command again, as one line a user can paste
        then = " && " if fix.startswith("chattr ") else ", then "
        again = fix.replace("{again}", AGAIN) if "{again}" in fix else f"{fix}{then}{AGAIN}"
        return WriteFailed(f"cannot {action} {rel}", f"{cause}; nothing was changed", again)
    return WriteFailed(
        f"cannot {action} {rel}",
        f"{cause}; the tree could not be put back",
        f"{fix.replace('{again}', 'it')}{' && ' if fix.startswith('chattr ') else ', then '}"
        f"patch-dsv4 apply{env.target.args()} (or revert) finishes it",
    )


def _cause(path, exc: Exception) -> tuple[str, str] | None:
    """(the error and its cause in words, what removes it) of a write refused at ``path`` (a file, or the state
    directory), where something on disk says it (an immutable or append-only file or directory, a read-only file
    system, a mode this user may not write); None where the error says all there is."""
    import errno

    from patch_dsv4.tree import mounts

    if not isinstance(exc, OSError) or exc.errno not in (errno.EPERM, errno.EACCES, errno.EROFS):
        return None
    reason = _os_reason(exc)
    path = path if os.path.lexists(path) else path.parent
    why = mounts.why_unreplaceable(str(path), mounts.read_mounts()) or ""
    for flag, kind in (("i", "immutable"), ("a", "append-only")):
        if f"is {kind} (chattr +{flag})" in why:
            held, which = (path, "the file") if why.startswith("the file") else (path.parent, "its directory")
            return (
                f"{reason}: {which} is {kind} (chattr +{flag}; lsattr shows it)",
                f"chattr -{flag} {shlex.quote(str(held))}",
            )
    if why.startswith("on a read-only file system"):
        return f"{reason}: the file system is read-only", "patch the image it comes from, or remount it read-write"
    if why:
        return f"{reason}: {why}", "fix the cause"
    effective = os.access in os.supports_effective_ids
    if exc.errno == errno.EROFS or os.access(path, os.W_OK, effective_ids=effective):
        return None  # nothing on disk says more than the error
    try:
        st = os.stat(path)
    except OSError:
        return None
    owner, me = user_name(st.st_uid), user_name(os.geteuid())
    return (
        f"{reason}: {me} may not write {path} (owner {owner}, mode {stat.filemode(st.st_mode)})",
        f"{{again}}, as {owner}" + ("" if owner == "root" else " or as root"),
    )


# -- one target file -------------------------------------------------------------------
@dataclass(frozen=True)
class _Target:
    relpath: str
    old: bytes
    new: bytes
    owner: Owner


def _target(env: Environment, relpath: str, old: bytes, new: bytes) -> _Target:
    st = env.tree.stat(relpath)
    return _Target(relpath, old, new, Owner(st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)))


def _bytecode_dir(directory: Dir) -> Dir | None:
    try:
        return directory.child("__pycache__")
    except UnsafePath as exc:
        raise UnsafePath(f"refusing {directory.path / '__pycache__'}", exc.why) from None


def _remove_bytecode(directory: Dir, name: str) -> None:
    """Remove every cached .pyc of ``name``: an unchecked-hash .pyc is never revalidated."""
    stem = name[: -len(".py")] if name.endswith(".py") else name
    cache = _bytecode_dir(directory)
    if cache is not None:
        with cache:
            for entry in cache.names():
                if entry.endswith(".pyc") and entry.split(".")[0] == stem:
                    cache.unlink(entry)
    directory.unlink(stem + ".pyc")


def _probe(env: Environment, target: _Target) -> None:
    directory, name = env.tree.parent_dir(target.relpath)
    with directory:
        env.tree.check_file_link(directory, name)
        _bytecode_dir(directory)  # a planted link there is refused now, not half-way
        directory.probe_writable(name, target.new)


def _replace(env: Environment, relpath: str, data: bytes, owner: Owner) -> None:
    directory, name = env.tree.parent_dir(relpath)
    with directory:
        env.tree.check_file_link(directory, name)
        _remove_bytecode(directory, name)
        directory.write_atomic(name, data, owner)
        _remove_bytecode(directory, name)


def _put_back(env: Environment, done: list[_Target], data_of) -> bool:
    """Replace each file in ``done`` by ``data_of(target)``; whether all went back."""
    ok = True
    for target in reversed(done):
        data = data_of(target)
        try:
            if env.sha256(target.relpath) != sha256_bytes(data):
                _replace(env, target.relpath, data, target.owner)
        except (OSError, UnsafePath):
            ok = False
    return ok


# -- apply ------------------------------------------------------------------------------
def write_apply(
    env: Environment,
    store: StateStore,
    previous: Manifest | None,
    manifest: Manifest,
    planned: dict[str, bytes],
    originals: dict[str, bytes] | None = None,
    command: str = "apply",
) -> list[str]:
    """Write ``planned`` (relpath -> new bytes) and ``manifest`` (already holding the new entries): all or none.

    ``previous`` is the manifest on disk before this apply (None: no state),
    restored when the apply is undone. A file's backup holds its bytes as they
    are, or ``originals[relpath]`` where given (takeover: pip's bytes, from
    another tool's backup), so that revert restores those. ``command``: the one being run (apply or takeover),
    as an interrupt names it.
    """
    originals = originals or {}
    targets = []
    for relpath, new in planned.items():
        old = env.read_bytes(relpath)
        if old is None:
            raise WriteFailed(f"cannot patch {relpath}", "it vanished while we planned")
        targets.append(_target(env, relpath, old, new))
    new_backups = [t for t in targets if previous is None or t.relpath not in previous.files]
    journal = _journal(manifest, "apply", targets)

    current = "the state directory"
    try:
        for t in new_backups:
            current = f"the backup of {t.relpath}"
            store.write_copy("backups", t.relpath, originals.get(t.relpath, t.old))
        for t in targets:
            current = f"the staged copy of {t.relpath}"
            store.write_copy("staged", t.relpath, t.new)
        for t in targets:
            current = t.relpath
            _probe(env, t)
        checkpoint("prepared")
        current = "the journal"
        begun(command)
        store.save(journal)
    except (OSError, UnsafePath) as exc:
        undone = _undo_prepare(store, previous, new_backups)
        raise _failure("write", current, exc, undone, env) from None
    except KeyboardInterrupt:
        raise _interrupted(command, _undo_prepare(store, previous, new_backups)) from None

    done: list[_Target] = []
    try:
        for t in targets:
            current = t.relpath
            done.append(t)  # before the write: a failure after its rename must still put it back
            _replace(env, t.relpath, t.new, t.owner)
        current = "the manifest"
        store.save(manifest)
    except (OSError, UnsafePath) as exc:
        undone = _put_back(env, done, lambda t: t.old) and _undo_prepare(store, previous, new_backups)
        raise _failure("write", current, exc, undone, env) from None
    except KeyboardInterrupt:
        undone = _put_back(env, done, lambda t: t.old) and _undo_prepare(store, previous, new_backups)
        raise _interrupted(command, undone) from None
    completed(f"{command} completed: patched {len(targets)} file(s)")
    try:
        store.clear_staged()
    except OSError:
        pass  # the next run's recovery removes leftover staged copies; the apply itself is complete
    return _read_only_notes(targets, "patched")


def _read_only_notes(targets: list[_Target], done: str) -> list[str]:
    """A file written though its mode lets no one write it (root may): it keeps its mode, and the report says so."""
    read_only = [t for t in targets if not t.owner.mode & 0o222]
    if not read_only:
        return []
    mode = stat.filemode(stat.S_IFREG | read_only[0].owner.mode)
    return [
        f"{done} {len(read_only)} file(s) whose mode lets no one write them (mode {mode}, e.g. "
        f"{read_only[0].relpath}): root may write them, and each keeps its mode"
    ]


def _interrupted(op: str, undone: bool) -> Interrupted:
    """What an interrupt during ``op``'s write leaves: nothing changed (all put back), or a journal to finish. The
    next step, the same command again (it finishes a journal first), is the command line's to name."""
    if undone:
        return Interrupted(f"interrupted: {op} changed nothing", "what it had begun was put back")
    return Interrupted(
        f"interrupted while {op} wrote the files",
        f"its journal is kept in {STATE_DIR}/: the next apply or revert finishes it",
    )


def _journal(manifest: Manifest, op: str, targets: list[_Target]) -> Manifest:
    """The manifest to save before the first file is replaced: ``manifest`` with the transaction under way (each
    file's hash before and after), which recovery reads after a crash."""
    journal = copy.deepcopy(manifest)
    journal.transaction = {
        "op": op,
        "files": {t.relpath: {"from": sha256_bytes(t.old), "to": sha256_bytes(t.new)} for t in targets},
    }
    return journal


def _undo_prepare(store: StateStore, previous: Manifest | None, new_backups) -> bool:
    """Put the state back as it was before the apply; whether that worked."""
    try:
        if previous is None:
            store.remove()
            return True
        store.save(previous)
        for t in new_backups:
            store.remove_copy("backups", t.relpath)
        store.clear_staged()
        return True
    except (OSError, UnsafePath):
        return False


# -- revert -----------------------------------------------------------------------------
def write_revert(env: Environment, store: StateStore, manifest: Manifest, restore: dict[str, bytes]) -> list[str]:
    """Put each file in ``restore`` (relpath -> backup bytes) back, then drop the state: all or none."""
    targets = []
    for relpath, old in restore.items():
        now = env.read_bytes(relpath)
        if now is None:
            raise WriteFailed(f"cannot restore {relpath}", "it vanished")
        targets.append(_target(env, relpath, now, old))
    journal = _journal(manifest, "revert", targets)
    current = "the journal"
    try:
        for t in targets:
            current = t.relpath
            _probe(env, t)
        current = "the journal"
        begun("revert")
        store.save(journal)
    except (OSError, UnsafePath) as exc:
        raise _failure("restore", current, exc, _restore_manifest(store, manifest), env) from None
    except KeyboardInterrupt:
        raise _interrupted("revert", _restore_manifest(store, manifest)) from None
    done: list[_Target] = []
    try:
        for t in targets:
            current = t.relpath
            done.append(t)  # before the write: a failure after its rename must still put it back
            _replace(env, t.relpath, t.new, t.owner)
        current = "the state"
        store.remove()
        completed(f"revert completed: restored {len(targets)} file(s)")
    except KeyboardInterrupt:
        if done and len(done) == len(targets) and not store.manifest_exists():
            completed(f"revert completed: restored {len(targets)} file(s)")
            raise
        undone = _put_back(env, done, lambda t: t.old) and _restore_manifest(store, manifest)
        raise _interrupted("revert", undone) from None
    except (OSError, UnsafePath) as exc:
        if done and len(done) == len(targets) and not store.manifest_exists():
            # Every file is restored and the manifest is gone: the revert is complete;
            # what is left of the state directory is backups no file needs any more.
            raise WriteFailed(
                "reverted, but could not remove all of the state",
                _os_reason(exc) if isinstance(exc, OSError) else str(exc),
                f"rm -r {shlex.quote(str(store.dir_path))}",
            ) from None
        undone = _put_back(env, done, lambda t: t.old) and _restore_manifest(store, manifest)
        raise _failure("restore", current, exc, undone, env) from None
    return _read_only_notes(targets, "restored")


def _restore_manifest(store: StateStore, manifest: Manifest) -> bool:
    try:
        store.save(manifest)
        return True
    except (OSError, UnsafePath):
        return False


# -- recovery -----------------------------------------------------------------------------
def recover(env: Environment, store: StateStore) -> tuple[list[str], Manifest | None | bool, Refused | None]:
    """Finish what a killed apply or revert started (call with the lock held): notes on what was done, the
    manifest as it leaves it (True where it wrote one: read it again), and the refusal where it cannot finish.

    A journalled apply is rolled forward from its staged copies, a journalled
    revert from the backups; temp files a killed writer left are removed. A
    state directory without a manifest to go by is rebuilt before this runs
    (:func:`patch_dsv4.pipeline.commands.rebuild`).
    """
    try:
        return _recover(env, store)
    except KeyboardInterrupt:
        raise Interrupted(
            "interrupted while finishing an earlier interrupted apply or revert",
            f"its journal is kept in {STATE_DIR}/: the next apply or revert finishes it",
        ) from None


def _recover(env: Environment, store: StateStore) -> tuple[list[str], Manifest | None | bool, Refused | None]:
    notes: list[str] = []
    manifest = store.load()
    for relpath in store.declared:
        _remove_stray_temps(env, relpath)
    if manifest is None:  # a state directory without one was rebuilt before (patch_dsv4.pipeline.commands.rebuild)
        return notes, None, None
    store.remove_stray_temps()
    if manifest.transaction is None:
        if store.has_staged():  # copies in it, or none left by an apply interrupted while it removed them
            store.clear_staged()
        return notes, manifest, None
    op = manifest.transaction["op"]
    source = "staged" if op == "apply" else "backups"
    refusal = _replay(env, store, manifest, source)
    if refusal is not None:
        return notes, manifest, refusal
    if op == "apply":
        manifest.transaction = None
        store.save(manifest)
        store.clear_staged()
        notes.append("finished an interrupted apply from its journal")
        return notes, True, None
    store.remove()
    notes.append("finished an interrupted revert from its journal")
    return notes, None, None


def _remove_stray_temps(env: Environment, relpath: str) -> None:
    try:
        directory, name = env.tree.parent_dir(relpath)
    except (FileNotFoundError, NotADirectoryError, UnsafePath):
        return
    with directory:
        directory.remove_stray_temps(name)


def _replay(env: Environment, store: StateStore, manifest: Manifest, source: str) -> Refused | None:
    """Move each file of the journalled transaction to its "to" bytes, read from the ``source`` copies.

    A file already there is left alone; one that is neither "from" nor "to"
    changed behind our back and stops the replay, nothing more written: the refusal says so.
    """
    op = manifest.transaction["op"]
    for relpath, move in manifest.transaction["files"].items():
        now = env.sha256(relpath)
        if now == move["to"]:
            continue
        if now != move["from"]:
            return Refused(
                f"cannot finish the interrupted {op} of {relpath}",
                "the file changed since",
                env.reinstall_then(op),
            )
        data = store.read_copy(source, relpath)
        if data is None or sha256_bytes(data) != move["to"]:
            return Refused(f"the saved copy of {relpath} is missing or damaged", "", f"{env.reinstall()}")
        st = env.tree.stat(relpath)
        _replace(env, relpath, data, Owner(st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)))
    return None


# -- a lost state, rebuilt ------------------------------------------------------------------
def commit_rebuild(store: StateStore, rebuild: Rebuild) -> str:
    """Write a rebuilt state (call with the lock held, never with a refusal): set aside what it keeps (an
    unreadable manifest, backups it cannot use) under saved-edits/, remove the backups it drops and any staged
    copies, write the backups it adds, then the manifest, atomically and last; or, where no file carries our edits,
    remove the state. vLLM's files are not touched. Until the manifest is written the state is as lost as it was,
    and the next apply or revert rebuilds it again from the same proof. Where the kept files are ("" for none)."""
    lost = rebuild.lost
    kept_in = ""
    try:
        if lost.unreadable or rebuild.keep:
            kept_in = store.keep_aside(bool(lost.unreadable), rebuild.keep)
        for relpath in rebuild.drop:
            store.remove_copy("backups", relpath)
        store.clear_staged()
        store.remove_stray_temps()
        for relpath, data in rebuild.backups.items():
            store.write_copy("backups", relpath, data)
        if rebuild.manifest is not None:
            store.save(rebuild.manifest)
        elif lost.present:
            store.remove()
    except (OSError, UnsafePath) as exc:
        reason = exc.line() if isinstance(exc, EnvironmentProblem) else _os_reason(exc)
        raise WriteFailed(
            f"cannot rebuild the state {store.dir_path}",
            f"{reason}; vLLM's files were not changed, and the next apply or revert rebuilds it again",
            f"fix the cause, then {AGAIN}",
        ) from None
    return kept_in


# -- committing a plan ----------------------------------------------------------------------
def commit(plan: Plan) -> Committed:
    """Carry out ``plan`` (call with the lock held, never with a refusal): save the files it saves, write its
    files and its manifest, all or none, or remove the state it removes."""
    state = plan.state
    env, store = state.env, state.store
    if plan.command == "revert":
        if plan.previous is None:  # no state to revert: a stale one, or an empty directory, goes
            store.remove_legacy()
            if plan.remove_state:
                store.remove()
            elif store.remove_if_empty():
                return Committed(notes=(f"removed the empty {STATE_DIR}/ an interrupted run left",))
            return Committed()
        saved = save_local_edits(env, store, plan.save)
        notes = write_revert(env, store, plan.previous, plan.new)
        return Committed(tuple(saved), tuple(notes))
    if plan.remove_state:
        store.remove()
    store.remove_legacy()  # what older versions kept and none reads: gone, readable or not
    if not plan.writes:
        if plan.manifest is not None:
            store.save(plan.manifest)
            completed(f"{plan.command} completed: recorded the opt-ins in the state")
        return Committed()
    saved = save_local_edits(env, store, plan.save)
    notes = write_apply(
        env, store, plan.previous, plan.manifest, plan.new, originals=plan.originals, command=plan.command
    )
    return Committed(tuple(saved), tuple(notes))


def save_local_edits(env: Environment, store: StateStore, relpaths: list[str]) -> list[str]:
    """Save each file (as it is now) in a fresh run directory under saved-edits/; where each was saved.

    Each is read only where it resolves inside the package, and saved with its own owner and mode.
    """
    if not relpaths:
        return []
    copies = []
    for relpath in relpaths:
        try:
            copies.append((relpath, *env.tree.read_contained(relpath)))
        except UnsafePath as exc:
            raise Refused(f"refusing to save {relpath}", exc.why or exc.what, env.reinstall()) from None
    run = store.new_saved_edits_run()
    return [str(store.save_local_edit(run, relpath, data, owner)) for relpath, data, owner in copies]
