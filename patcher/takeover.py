"""Taking over from another tool's edits: the files to restore, and the bytes that restore them.

The recipes' patch scripts leave a backup beside each file they edit
(``<file>.orig``, ``.orig-wideswa``, ``.orig-lna``...). The first script to
touch a file backs up what pip installed; a later script's backup of the same
file holds the earlier script's edit. So a backup is chosen by its hash
against pip's RECORD, never by its name: any regular file beside the edited
one whose name starts with the file's name and whose sha256 is the one RECORD
lists. Where no backup holds them (kits that keep none), ``takeover`` reads them from the release's own wheel
(:mod:`patch_dsv4.release_wheel`). Nothing here writes: planning (:mod:`patch_dsv4.planning`) uses these, the
transaction commits.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from patch_dsv4.environment import Environment, record_digest
from patch_dsv4.fs import MAX_SOURCE_BYTES, UnsafePath
from patch_dsv4.verdicts import Verdict

if TYPE_CHECKING:
    from patch_dsv4.judge import Judgement

#: (relpath, wheel) -> (where from, pip's bytes): the sibling backup that holds what pip installed, else (``wheel``
#: and the command reads it) the release's wheel; None when neither does
PipCopy = Callable[..., "tuple[str, bytes] | None"]


@dataclass(frozen=True)
class Restore:
    """One foreign-edited file and the sibling backup whose bytes are pip's."""

    relpath: str
    backup: str | None  # where pip's bytes come from: the backup's file name beside it, or the release wheel
    data: bytes | None  # pip's bytes; None when neither a backup nor the wheel holds them
    scripts: tuple[str, ...]  # the tools whose edits were recognised in it


def foreign_files(judgement: Judgement) -> dict[str, tuple[str, ...]]:
    """Every file holding a recognised foreign edit (of any patch, opt-ins too), with the scripts seen there."""
    found: dict[str, dict[str, None]] = {}
    for pairs in judgement.outcomes.values():
        for edit, outcome in pairs:
            if outcome.verdict is Verdict.FOREIGN:
                found.setdefault(edit.file, {})[outcome.foreign or "another tool"] = None
    return {rel: tuple(scripts) for rel, scripts in sorted(found.items())}


def kept_edits(judgement: Judgement) -> list[str]:
    """The other tools' edits patch-dsv4 has no equivalent for, found where the patches read: takeover leaves
    them in place ("<file>: <script> (<tool>)")."""
    return sorted({who for pairs in judgement.outcomes.values() for _, outcome in pairs for who in outcome.kept})


def foreign_patches(judgement: Judgement) -> set[str]:
    return {pid for pid, pairs in judgement.outcomes.items() if any(o.verdict is Verdict.FOREIGN for _, o in pairs)}


def record_backup(env: Environment, relpath: str) -> tuple[str, bytes] | None:
    """The sibling backup of ``relpath`` that holds exactly what pip installed (by RECORD's hash), if any.

    Only regular files inside the package are read, never through a link; the
    candidates are tried in name order; one bigger than any source file is
    skipped unread.
    """
    recorded = env.recorded_hash(relpath)
    if recorded is None:
        return None
    try:
        directory, name = env.tree.parent_dir(relpath)
    except (OSError, UnsafePath):
        return None
    with directory:
        for candidate in sorted(directory.names()):
            if candidate == name or not candidate.startswith(name + ".") or candidate.endswith(".pyc"):
                continue
            st = directory.lstat(candidate)
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SOURCE_BYTES:
                continue
            try:
                data = directory.read_bytes(candidate, limit=MAX_SOURCE_BYTES)
            except OSError:
                continue
            if record_digest(data) == recorded:
                return candidate, data
    return None


def plan_restores(judgement: Judgement, pip_copy: PipCopy, also: Iterable[str] = ()) -> list[Restore]:
    """For each foreign-edited file, the backup that restores pip's bytes (or None where there is none).

    ``also`` are other files the patches edit that differ from RECORD: each is
    restored too where a backup beside it holds pip's bytes (another tool's
    backup: its edit is saved, as the recognised ones are), else left alone
    (never from the wheel: an edit nobody recognised is not taken over on a guess).
    """
    restores = []
    foreign = foreign_files(judgement)
    for relpath, scripts in foreign.items():
        found = pip_copy(relpath)
        restores.append(Restore(relpath, found[0] if found else None, found[1] if found else None, scripts))
    for relpath in sorted(set(also) - set(foreign)):
        found = pip_copy(relpath, wheel=False)
        if found is not None:
            restores.append(Restore(relpath, found[0], found[1], ("an edit patch-dsv4 does not recognise",)))
    return restores


def takeover_next(env: Environment, judgement: Judgement, pip_copy: PipCopy) -> str:
    """The one command that moves a tree with other tools' edits to ours: takeover, or a reinstall where neither a
    backup nor the release's wheel can hold pip's bytes (nothing is fetched to decide it)."""
    from patch_dsv4.release_wheel import unobtainable

    restores = plan_restores(judgement, lambda relpath, wheel=True: pip_copy(relpath, wheel=False))
    kept = kept_edits(judgement)
    if any(who.startswith(f"{r.relpath}: ") for r in restores for who in kept):  # takeover would refuse that file
        return f"patch-dsv4 apply{env.target.args()} (the other tool's edits stay where patch-dsv4 never removes one)"
    command = f"patch-dsv4 takeover{env.target.args()}"
    if restores and all(r.data is not None for r in restores):
        return f"{command} (saves the edited files, restores pip's from their backups)"
    if restores and unobtainable(env.vllm_version) is None:
        return f"{command} (saves the edited files, restores pip's from backups or the vllm=={env.vllm_version} wheel)"
    return env.reinstall_then()
