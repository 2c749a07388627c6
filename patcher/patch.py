"""The unit of work: a Patch declares its edits; the engine judges and writes them.

A patch module in ``patches/`` defines one subclass of :class:`Patch` and,
optionally, ``EXAMPLES`` (before/after snippets the test-suite turns into
tests). See ``patches/stream_load.py`` for the model to copy.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Sequence

from patcher.verdicts import Outcome, Verdict


@dataclass
class Context:
    """What a patch may look at: the target's files and releases, never imported.

    ``read`` returns the text of a file of the vLLM tree (relative path, e.g.
    ``vllm/models/deepseek_v4/common/vl_model.py``) or None when it is absent.
    ``read_flashinfer`` does the same for an installed FlashInfer (None when
    FlashInfer is only pinned or absent).
    """

    vllm_version: str
    flashinfer_version: str | None
    flashinfer_source: str | None
    read_file: Callable[[str], str | None]
    read_flashinfer_file: Callable[[str], str | None] = lambda _relpath: None
    _texts: dict[str, str | None] = field(default_factory=dict, repr=False)
    _trees: dict[str, ast.Module | None] = field(default_factory=dict, repr=False)

    def read(self, relpath: str) -> str | None:
        if relpath not in self._texts:
            self._texts[relpath] = self.read_file(relpath)
        return self._texts[relpath]

    def read_flashinfer(self, relpath: str) -> str | None:
        return self.read_flashinfer_file(relpath)

    def ast(self, relpath: str) -> ast.Module | None:
        """The parsed file, or None when absent or not valid Python."""
        if relpath not in self._trees:
            text = self.read(relpath)
            try:
                self._trees[relpath] = None if text is None else ast.parse(text)
            except SyntaxError:
                self._trees[relpath] = None
        return self._trees[relpath]

    def files_read(self) -> list[str]:
        return sorted(self._texts)


@dataclass(frozen=True)
class Example:
    """A before/after pair for one edit of a patch, run by tests/test_examples.py.

    ``after`` None means the edit must leave ``before`` alone with ``verdict``.
    """

    name: str
    file: str
    before: str
    after: str | None
    verdict: Verdict = Verdict.PENDING
    vllm_version: str = "0.0.0"
    flashinfer_version: str | None = None


class Edit:
    """One change to one file. Subclasses implement :meth:`evaluate`."""

    label: str
    file: str

    def evaluate(self, ctx: Context, text: str | None) -> Outcome:
        """Judge ``text`` (the file as it is now, or as planned so far).

        Return PENDING with ``new_text`` when the edit would change it, APPLIED
        when the edit is in place (then running it again must change nothing),
        or UPSTREAM / NOT_APPLICABLE / DRIFTED with evidence.
        """
        raise NotImplementedError

    def injected_code(self) -> Sequence[str]:
        """Source text this edit writes into vLLM, for the static name checks."""
        return ()


class Patch:
    """Base class of every patch. The docstring of a subclass is its "why"."""

    id: ClassVar[str]
    title: ClassVar[str]

    def edits(self, ctx: Context) -> list[Edit]:
        raise NotImplementedError

    @classmethod
    def why(cls) -> str:
        return (cls.__doc__ or "").strip()


def injected_names_prefix() -> str:
    """Every name a patch injects starts with this: it marks a file as ours."""
    return "_patch_dsv4_"
