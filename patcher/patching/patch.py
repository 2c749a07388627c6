"""The unit of work: a Patch declares its edits; the engine judges and writes them.

A patch module in ``patches/`` defines one subclass of :class:`Patch` and,
optionally, ``EXAMPLES`` (before/after snippets the test-suite turns into
tests). See ``patches/stream_load.py`` for the model to copy.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

from patch_dsv4.output.errors import EnvironmentProblem
from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patching.source import Source, SourceError, decode_source
from patch_dsv4.tree.fs import DanglingLink


@dataclass(frozen=True)
class FileProblem:
    """Why a file cannot be judged from as it is.

    ``hard``: it cannot be read as Python source at all (not a regular file, a
    link that leads nowhere or out of the package, undecodable, too big). Not
    hard: it reads, but it is not the file pip installed (it differs from RECORD).
    """

    why: str
    hard: bool
    missing: bool = False  # absent, though pip's RECORD lists it


@dataclass
class _File:
    data: bytes | None
    source: Source | None
    problem: FileProblem | None


@lru_cache(maxsize=128)
def parse_text(text: str) -> ast.Module:
    """``ast.parse(text)``, kept for the texts a run (or a test session's runs) reads again: apply on 0.34.0
    reads 37 (about 36 MB of trees), so a smaller cache read in a cycle would miss every time.

    The trees are shared: nothing may change them (the fingerprint's cache on a node is the same for every reader).
    """
    return ast.parse(text)


class Context:
    """What a patch may look at: the target's files and releases, never imported.

    ``read`` returns the text of a file of the vLLM tree (relative path, e.g.
    ``vllm/models/deepseek_v4/common/vl_model.py``) or None when it is absent or
    cannot be read; :meth:`problem` says why a file cannot be judged from.
    ``read_flashinfer`` does the same for an installed FlashInfer (None when
    FlashInfer is only pinned or absent). Every file is read once.
    """

    def __init__(
        self,
        vllm_version: str,
        flashinfer_version: str | None,
        flashinfer_source: str | None,
        read_bytes: Callable[[str], bytes | None],
        read_flashinfer_bytes: Callable[[str], bytes | None] = lambda _relpath: None,
        check_installed: Callable[[str, bytes | None], str | None] = lambda _relpath, _data: None,
        flashinfer_given: bool = False,
        flashinfer_pin_served: bool | None = None,
        recorded: dict | None = None,
    ) -> None:
        self.vllm_version = vllm_version
        self.flashinfer_version = flashinfer_version
        self.flashinfer_source = flashinfer_source
        self.flashinfer_given = flashinfer_given  # drift --flashinfer-version named it (judged as a pin)
        # whether pip's index serves the pinned FlashInfer: asked only where the command may use the network
        # (drift --vllm-version); None: not checked (status, apply, verify stay offline)
        self.flashinfer_pin_served = flashinfer_pin_served
        self._read_bytes = read_bytes
        self._read_flashinfer_bytes = read_flashinfer_bytes
        self._check_installed = check_installed
        self._files: dict[str, _File] = {}
        self._trees: dict[str, ast.Module | None] = {}
        self._readers: list[set[str]] = []
        self._lookups: list[set[tuple[str, str, bool]]] = []
        self._memo: dict[tuple, tuple[object, frozenset[str], frozenset[tuple[str, str, bool]]]] = {}
        # probe answers recorded for a release (anchors/: key -> the sha256 of each file the probe read, and its
        # answer); None where nothing is recorded
        self._recorded = recorded
        self.probe_log: dict[str, tuple[frozenset[str], object]] | None = None  # filled when a record is made

    @classmethod
    def from_texts(
        cls,
        texts: dict[str, str],
        vllm_version: str = "0.0.0",
        flashinfer_version: str | None = None,
        flashinfer_source: str | None = None,
    ) -> Context:
        """A context over a few files given as text (examples and unit tests)."""
        return cls(
            vllm_version,
            flashinfer_version,
            flashinfer_source,
            lambda rel: texts[rel].encode() if rel in texts else None,
        )

    def _file(self, relpath: str) -> _File:
        for readers in self._readers:
            readers.add(relpath)
        if relpath in self._files:
            return self._files[relpath]
        data = source = problem = None
        try:
            data = self._read_bytes(relpath)
        except DanglingLink as exc:
            problem = FileProblem(str(exc), hard=True)
        except OSError as exc:  # a directory, a device, a link loop, no permission: the tree is broken
            raise EnvironmentProblem(
                f"cannot read {relpath}",
                exc.strerror or str(exc),
                "restore the file (reinstall vLLM), then run the command again",
            ) from None
        if data is not None:
            try:
                source = decode_source(data)
            except SourceError as exc:
                problem = FileProblem(f"{relpath} is not readable Python source: {exc}", hard=True)
        if problem is None:
            why = self._check_installed(relpath, data)
            if why is not None:
                problem = FileProblem(why, hard=False, missing=data is None)
        self._files[relpath] = _File(data if problem is None or not problem.hard else None, source, problem)
        return self._files[relpath]

    def read(self, relpath: str) -> str | None:
        found = self._file(relpath)
        return found.source.text if found.source is not None else None

    def source(self, relpath: str) -> Source | None:
        return self._file(relpath).source

    def raw(self, relpath: str) -> bytes | None:
        return self._file(relpath).data

    def problem(self, relpath: str) -> FileProblem | None:
        return self._file(relpath).problem

    def parse(self, text: str) -> ast.Module:
        """``ast.parse(text)``, each distinct text parsed once (SyntaxError propagates)."""
        return parse_text(text)

    def ast(self, relpath: str) -> ast.Module | None:
        """The parsed file, or None when absent or not valid Python."""
        if relpath not in self._trees:
            text = self.read(relpath)
            try:
                self._trees[relpath] = None if text is None else self.parse(text)
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                self._trees[relpath] = None
        else:
            self._file(relpath)  # count the read for whoever asks
        return self._trees[relpath]

    def scope(self, relpath: str, cls: str | None, func: str | None) -> ast.AST | None:
        """The class or function of a file (module level only), or None; the look-up is recorded.

        A judgement that found no such scope in a file pip did not install as it
        is cannot be trusted (the scope may have been edited away): the engine
        reports it as not judged. Probes look their evidence up through here.
        """
        from patch_dsv4.patching.fingerprint import find_scope

        tree = self.ast(relpath)
        node = find_scope(tree, cls, func) if tree is not None else None
        self.looked_up(relpath, str(Scope(cls, func)), node is not None)
        return node

    def looked_up(self, relpath: str, what: str, found: bool) -> None:
        """Record that a judgement looked for ``what`` in ``relpath`` (and whether it was there)."""
        for lookups in self._lookups:
            lookups.add((relpath, what, found))

    def memo(self, key: tuple, compute: Callable[[], object]) -> object:
        """``compute()``, once per context and key: the files it read and the look-ups it made are recorded
        again on every later call, so a judgement that reuses a result depends on what that result read."""
        hit = self._memo.get(key)
        if hit is None:
            with self.recording() as reads, self.recording_lookups() as lookups:
                result = compute()
            hit = self._memo[key] = (result, frozenset(reads), frozenset(lookups))
            return result
        result, reads, lookups = hit
        for readers in self._readers:
            readers.update(reads)
        for recorded in self._lookups:
            recorded.update(lookups)
        return result

    def recall(self, key: str) -> tuple[bool, object]:
        """(whether it is recalled, the answer) of the probe ``key`` where its release's record holds one and
        every file that probe read there is here, byte for byte (the same bytes give the same answer), and none
        is a file pip did not install as it is; the files are read (and counted as read) either way."""
        entry = self._recorded.get(key) if self._recorded else None
        if entry is None:
            return False, None
        import hashlib

        for relpath, sha in entry["files"].items():
            data = self.raw(relpath)
            if self.problem(relpath) is not None:
                return False, None
            if (None if data is None else hashlib.sha256(data).hexdigest()) != sha:
                return False, None
        return True, entry["answer"]

    def read_flashinfer(self, relpath: str) -> str | None:
        data = self._read_flashinfer_bytes(relpath)
        if data is None:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return None

    def files_read(self) -> list[str]:
        return sorted(self._files)

    @contextmanager
    def recording(self) -> Iterator[set[str]]:
        """Collect the files read inside the block (a patch's judgement reads them)."""
        reads: set[str] = set()
        self._readers.append(reads)
        try:
            yield reads
        finally:  # by identity: two recordings may hold equal sets
            self._readers = [r for r in self._readers if r is not reads]

    @contextmanager
    def recording_lookups(self) -> Iterator[set[tuple[str, str, bool]]]:
        """Collect the scope look-ups made inside the block: (file, scope, found)."""
        lookups: set[tuple[str, str, bool]] = set()
        self._lookups.append(lookups)
        try:
            yield lookups
        finally:
            self._lookups = [r for r in self._lookups if r is not lookups]


#: Every name a patch injects starts with this: it marks a file as ours, even without the state.
INJECTED_PREFIX = "_patch_dsv4_"


def marker_comment(patch_id: str) -> str:
    """The comment every replacement carries, so that a reader of the patched file knows who wrote it."""
    return f"# patch-dsv4 ({patch_id})"


@dataclass(frozen=True)
class Example:
    """A before/after pair for a patch, run through the engine by tests/patches/test_examples.py.

    ``after`` is the file exactly as the patch writes it (compared byte for
    byte), or None when the patch must leave ``before`` alone with ``verdict``.
    Write ``after`` out literally, to be read side by side with ``before``;
    mark an example ``derived`` when its text is computed from the patch's own
    strings. ``with_helpers=False`` judges it without the injected helpers (whose
    source a separate test compares with the patch module), to keep it short.
    """

    name: str
    file: str
    before: str
    after: str | None
    verdict: Verdict = Verdict.PENDING
    vllm_version: str = "0.0.0"
    flashinfer_version: str | None = None
    derived: bool = False
    with_helpers: bool = True


@dataclass(frozen=True)
class Scope:
    cls: str | None
    func: str | None

    def __str__(self) -> str:
        return ".".join(p for p in (self.cls, self.func) if p) or "<module>"


class Edit:
    """One change to one file, inside one scope (class and/or function) of it.

    The engine calls :meth:`evaluate` on the file as it is, and, for every
    pending edit of a file, :meth:`rewrite` on its libcst tree, once per file.
    """

    label: str
    file: str
    scope: Scope  # where in ``file`` the edit applies: its anchors are matched there only

    def evaluate(self, ctx: Context, text: str | None) -> Outcome:
        """Judge ``text`` (None: the file is absent).

        Return PENDING when the edit would change it (``outcome.variant`` says
        which anchor matched), APPLIED when the edit is in place (then running it
        again must change nothing), or UPSTREAM / NOT_APPLICABLE / DRIFTED with
        evidence.
        """
        raise NotImplementedError

    def rewrite(self, module, outcome: Outcome):
        """The libcst module with this edit applied, as ``outcome`` (PENDING) planned it."""
        raise NotImplementedError

    def injected_code(self, outcome: Outcome) -> Sequence[str]:
        """Source text this edit writes into vLLM as ``outcome`` planned it, for the static name checks."""
        raise NotImplementedError


class Patch:
    """Base class of every patch: a module in patches/ defines one subclass.

    ``id`` (lower-case words joined by dashes), ``title`` (one line), ``edits``
    (the edits; edits of one scope need disjoint anchors), ``opt_in`` (applied only when
    asked for with ``apply --with ID``), ``serve_impact`` (what serving without it does,
    as the user meets it after the load: one clause, which doctor's rt.patches prints for
    a patch that is needed and missing). Its "why", shown by ``patch-dsv4 list``,
    is its module's docstring. Patches apply in the order of their ids.
    """

    id: ClassVar[str]
    title: ClassVar[str]
    edits: ClassVar[tuple[Edit, ...]]
    opt_in: ClassVar[bool] = False
    serve_impact: ClassVar[str | None] = None

    @classmethod
    def why(cls) -> str:
        module = sys.modules.get(cls.__module__)
        return ((module.__doc__ if module is not None else None) or cls.__doc__ or "").strip()

    @classmethod
    def files(cls) -> tuple[str, ...]:
        return tuple(dict.fromkeys(edit.file for edit in cls.edits))
