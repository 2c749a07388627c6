"""Start-up hooks that name vLLM: ``sitecustomize``, ``usercustomize`` and ``.pth`` lines that run code.

A kit can patch vLLM when the interpreter starts instead of in its files: Python imports ``sitecustomize`` and
``usercustomize`` from the import path at start-up (the first of each found), and runs each line of a ``.pth`` file
in a site directory that begins with ``import`` (the ``site`` module's rules). No RECORD or manifest sees what such a
hook changes at import, so ``verify`` can vouch for files only; these hooks are named (:func:`find_hooks`): a note
in ``status`` and ``verify``, a ``warn`` row of doctor (``rt.hooks``).

A hook is reported when it names ``vllm`` (an import, a module path in a string, ``sys.modules["vllm"]``) in its
code: the hook file itself, or for a ``.pth`` line its text and the module it imports (``import kit`` finds
``kit.py`` or ``kit/__init__.py`` on the same path, read once; :data:`FOLLOWED` modules at most). Nothing is
imported or run; every file is read at most :data:`LIMIT` bytes (one larger that names nothing in them is reported
as not read whole), regular files only.
Standard library only (os, through patch_dsv4.tree.installed).
"""

import os

from patch_dsv4.tree.installed import Unreadable, read_start

LIMIT = 1 << 20  # a hook read further than this is not read; sfxnz's largest sitecustomize.py is 60 KB
FOLLOWED = 32  # modules a run follows from .pth import lines (a real site: a handful); more are not looked for
CUSTOMIZE = ("sitecustomize", "usercustomize")
_SHOWN_MODULES = 6


class Hook:
    """A start-up hook that names vLLM: its file, its kind (``sitecustomize``, ``usercustomize`` or ``.pth``), the
    vLLM modules it names (``vllm`` itself, or dotted paths under it), and, for a ``.pth`` line that imports a
    module which names them, that module's file (``via``)."""

    __slots__ = ("path", "kind", "modules", "via", "whole")

    def __init__(self, path: str, kind: str, modules, via: str | None = None, whole: bool = True) -> None:
        self.path, self.kind, self.modules, self.via, self.whole = path, kind, tuple(sorted(modules)), via, whole

    def __repr__(self) -> str:
        return f"Hook({self.path!r}, {self.kind!r}, {self.modules!r}, via={self.via!r})"

    def to_json(self) -> dict:
        return {"file": self.path, "kind": self.kind, "modules": list(self.modules), "via": self.via}

    def named(self) -> str:
        """The vLLM modules it names, for a person: the first few, then how many more."""
        shown = ", ".join(self.modules[:_SHOWN_MODULES])
        more = len(self.modules) - _SHOWN_MODULES
        return (shown + (f" and {more} more" if more > 0 else "")) if self.modules else "none it could read"

    def note(self, site_packages: str | None = None, width: int = 74) -> str:
        """One line of at most ``width`` columns (74: the table prints it after ``note: ``, in 80): the file
        (relative to ``site_packages`` where it lies in it, shortened at its start where it must be), and what
        verify cannot see of it."""
        tail = (
            " hooks vllm: verify covers files, not import-time changes"
            if self.whole or self.modules
            else " may hook vllm (read in part): verify covers files only"
        )
        shown = self.path
        if site_packages:
            prefix = os.path.join(site_packages, "")
            shown = shown[len(prefix) :] if shown.startswith(prefix) else shown
        room = width - len(tail)
        if len(shown) > room:
            shown = "..." + shown[len(shown) - room + 3 :]
        return shown + tail


def vllm_names(text: str) -> set[str]:
    """The names ``vllm`` and ``vllm.a.b`` that stand in ``text`` as names (not inside a longer word), on lines that
    are not comments: what a hook imports or reaches into. No regular expression: verify's fast path calls it."""
    found = set()
    for line in text.splitlines():
        stripped = line.lstrip()
        if not stripped or stripped[0] == "#" or "vllm" not in line:
            continue
        at = line.find("vllm")
        while at >= 0:
            end = at + 4
            before = line[at - 1] if at else " "
            if not (before.isalnum() or before in "_.") and not (end < len(line) and _word(line[end])):
                while end + 1 < len(line) and line[end] == "." and (line[end + 1].isalpha() or line[end + 1] == "_"):
                    stop = end + 1
                    while stop < len(line) and _word(line[stop]):
                        stop += 1
                    end = stop
                found.add(line[at:end])
            at = line.find("vllm", end)
    return found


def _word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def _read_text(path: str) -> tuple[str, bool] | None:
    """A hook's text (at most LIMIT bytes, undecodable bytes replaced) and whether that is all of it; None where
    it is not a regular file that can be read (Python cannot run it either)."""
    try:
        data, whole = read_start(path, LIMIT)
    except (OSError, Unreadable):
        return None
    return data.decode("utf-8", "replace"), whole


def _module_file(name: str, directories) -> str | None:
    """Where ``import name`` (a top-level module) finds its source on ``directories``: the first ``name.py`` or
    ``name/__init__.py``."""
    for directory in directories:
        for candidate in (f"{name}.py", os.path.join(name, "__init__.py")):
            path = os.path.join(directory, candidate)
            if os.path.isfile(path):
                return path
    return None


def _imported(line: str) -> list[str]:
    """The top-level modules a ``.pth`` line that runs imports: site runs the whole line, so every statement of it
    (``import a.b, c as d; from e import f; __import__("g"); importlib.import_module("h")``)."""
    names = []
    for statement in line.split(";"):
        words = statement.split()
        if len(words) >= 2 and words[0] == "import":
            parts = statement.strip()[len("import") :].split(",")
        elif len(words) >= 4 and words[0] == "from" and words[2] == "import":
            parts = [words[1]]
        else:
            parts = [_string_argument(statement, call) for call in ("__import__(", "import_module(")]
        for part in parts:
            name = (part or "").strip().split(" ")[0].split(".")[0]
            if name.isidentifier() and name not in names:
                names.append(name)
    return names


def _string_argument(statement: str, call: str) -> str | None:
    """The literal string a call ``call`` (``__import__(``) is given first in ``statement``, where it is given one."""
    at = statement.find(call)
    if at < 0:
        return None
    rest = statement[at + len(call) :].lstrip()
    if not rest or rest[0] not in "'\"":
        return None
    end = rest.find(rest[0], 1)
    return rest[1:end] if end > 0 else None


def _customize_hooks(directories) -> list[Hook]:
    hooks = []
    for name in CUSTOMIZE:
        path = _module_file(name, directories)  # the import system runs the first one only
        if path is None:
            continue
        read = _read_text(path)
        if read is None:
            continue
        text, whole = read
        names = vllm_names(text)
        if names or not whole:
            hooks.append(Hook(path, name, names, whole=whole))
    return hooks


def _pth_hooks(site_dirs, directories) -> list[Hook]:
    hooks = []
    followed: dict[str, tuple[set[str], str] | None] = {}
    for directory in site_dirs:
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".pth"))
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            read = _read_text(path)
            if read is None:
                continue
            text, whole = read
            found: set[str] = set()
            via = None
            for line in text.splitlines():
                if not line.startswith(("import ", "import\t")):
                    continue  # only these lines run (site.addpackage)
                found |= vllm_names(line)
                for module in _imported(line):
                    if module == "vllm" or module in followed and followed[module] is None:
                        continue
                    if module not in followed and len(followed) >= FOLLOWED:
                        continue  # a hostile .pth's thousands of imports: each would be looked for on every path
                    if module not in followed:
                        module_path = _module_file(module, directories)
                        module_text = _read_text(module_path) if module_path else None
                        followed[module] = None if module_text is None else (vllm_names(module_text[0]), module_path)
                    entry = followed[module]
                    if entry is not None and entry[0]:
                        found |= entry[0]
                        via = via or entry[1]
            if found or not whole:
                hooks.append(Hook(path, ".pth", found, via, whole))
    return hooks


def find_hooks(directories, site_dirs=None) -> list[Hook]:
    """The start-up hooks that name vLLM, for an interpreter whose import path is ``directories`` (in order) and
    whose site directories (where ``.pth`` files run) are ``site_dirs`` (default: those of ``directories`` named
    site-packages or dist-packages): ``sitecustomize``, ``usercustomize``, then each ``.pth`` in name order."""
    directories = [str(d) for d in dict.fromkeys(directories)]
    if site_dirs is None:
        site_dirs = [d for d in directories if os.path.basename(d.rstrip("/")) in ("site-packages", "dist-packages")]
    site_dirs = [str(d) for d in dict.fromkeys(site_dirs)]
    return _customize_hooks(directories) + _pth_hooks(site_dirs, directories)


def notes(hooks: list[Hook], site_packages: str | None = None) -> list[str]:
    """A note per hook (:meth:`Hook.note`)."""
    return [hook.note(site_packages) for hook in hooks]
