"""What a state manifest may say: its paths and its fields, checked without touching the disk.

Light on purpose (standard library only, no classes built at import): the serve
guard and verify's fast path (:mod:`patch_dsv4.fastpath.quick`) apply the same rules as
:mod:`patch_dsv4.tree.state`, so a manifest the full path would call unreadable is
never vouched for by the fast one.
"""

TYPE_CHECKING = False  # typing's, without importing typing (4 ms) or collections (1 ms in a bare interpreter)
if TYPE_CHECKING:
    from collections.abc import Iterable

#: Manifest schemas this version reads (1: written before the patch digest was recorded).
READABLE_SCHEMAS = (1, 2)
VERDICTS = ("applied", "pending", "upstream", "not-applicable", "drifted", "modified", "opt-in", "foreign")
_HEX = "0123456789abcdef"  # a sha256 is 64 of these: checked without re, which costs a bare interpreter about 6 ms


def __getattr__(name: str):
    """``UnsafePath``, made on first use: an EnvironmentProblem of patch_dsv4.output.errors, which the serve guard,
    checking a manifest's fields, never imports (two modules: 0.3 ms of its first call)."""
    if name == "UnsafePath":
        return _unsafe_path()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _unsafe_path() -> type:
    made = globals().get("UnsafePath")
    if made is None:
        from patch_dsv4.output.errors import EnvironmentProblem

        class UnsafePath(EnvironmentProblem):
            """A path that would leave the environment, or a file that is not what it must be."""

        UnsafePath.__qualname__ = "UnsafePath"
        made = globals().setdefault("UnsafePath", UnsafePath)  # one class, whichever thread made it first
    return made


def _relpath_problem(relpath: object, what: str) -> tuple[str, ...] | str:
    """The parts of a relative, normalised POSIX path, or what is wrong with it."""
    if not isinstance(relpath, str) or not relpath:
        return f"{what} {relpath!r} is not a relative path"
    if "\0" in relpath or "\\" in relpath:
        return f"{what} {relpath!r} holds a NUL or a backslash"
    parts = tuple(relpath.split("/"))
    # Not absolute, and no empty, "." or ".." part: then posixpath.normpath(relpath) == relpath (without its cost)
    if relpath.startswith("/") or any(part in ("", ".", "..") for part in parts):
        return f"{what} {relpath!r} is not relative and normalised"
    return parts


def checked_relpath(relpath: object, what: str = "path") -> tuple[str, ...]:
    """The parts of a relative, normalised POSIX path; UnsafePath otherwise."""
    parts = _relpath_problem(relpath, what)
    if isinstance(parts, str):
        raise _unsafe_path()(parts)
    return parts


class InvalidManifest(ValueError):
    """The first thing wrong with a manifest."""


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise InvalidManifest(what)


def _str(value, what: str, optional: bool = False) -> None:
    _expect(isinstance(value, str) or (optional and value is None), f"{what} is not a string")


def _sha(value, what: str, optional: bool = False) -> None:
    _expect(
        (isinstance(value, str) and len(value) == 64 and not value.strip(_HEX)) or (optional and value is None),
        f"{what} is not a sha256",
    )


def _obj(value, what: str) -> dict:
    _expect(isinstance(value, dict), f"{what} is not an object")
    return value


def _declared(rel, declared: frozenset[str], what: str) -> None:
    problem = _relpath_problem(rel, what)
    _expect(not isinstance(problem, str), problem)
    _expect(rel in declared, f"{what} {rel!r} is not a file any patch edits")


def _source_path(rel, what: str) -> None:
    parts = _relpath_problem(rel, what)
    _expect(not isinstance(parts, str), parts)
    _expect(parts[0] == "vllm" and rel.endswith(".py"), f"{what} {rel!r} is not a source file of vllm/")


def check_manifest(data: object, declared: "Iterable[str]", patch_ids: "Iterable[str]") -> dict:
    """``data`` (a parsed manifest) when every field follows the rules; InvalidManifest naming the first problem.

    ``declared`` is every file the patches edit (the only paths ``files``, the
    verdicts and the journal may name); ``patch_ids`` the patches there are.
    """
    declared = frozenset(declared)
    ids = frozenset(patch_ids)
    data = _obj(data, "the manifest")
    _expect(
        data.get("schema") in READABLE_SCHEMAS, f"schema {data.get('schema')!r}, this tool reads {READABLE_SCHEMAS}"
    )
    _str(data.get("vllm_version"), "vllm_version")
    _str(data.get("tool_version"), "tool_version")
    _str(data.get("patch_digest"), "patch_digest", optional=True)
    files = _obj(data.get("files"), "files")
    for rel, entry in files.items():
        _declared(rel, declared, "file")
        entry = _obj(entry, f"files[{rel}]")
        patches = entry.get("patches")
        _expect(
            isinstance(patches, list) and all(isinstance(p, str) and p in ids for p in patches),
            f"files[{rel}].patches names unknown patches",
        )
        _sha(entry.get("before"), "before")
        _sha(entry.get("after"), "after")
    for pid, v in _obj(data.get("verdicts", {}), "verdicts").items():
        v = _obj(v, f"verdicts[{pid}]")
        _expect(pid in ids, f"verdicts names unknown patch {pid!r}")
        _expect(v.get("verdict") in VERDICTS, f"verdicts[{pid}].verdict is not a verdict")
        _str(v.get("title"), "title")
        _str(v.get("detail"), "detail")
        _expect(isinstance(v.get("files"), list), f"verdicts[{pid}].files is not a list")
        for rel in v["files"]:
            _declared(rel, declared, "verdict file")
        edits = v.get("edits", [])
        _expect(isinstance(edits, list), f"verdicts[{pid}].edits is not a list")
        for edit in edits:
            edit = _obj(edit, f"verdicts[{pid}].edits[]")
            _declared(edit.get("file"), declared, "verdict edit file")
            _expect(edit.get("verdict") in VERDICTS, f"verdicts[{pid}].edits[].verdict is not a verdict")
            for key in ("label", "scope", "detail"):
                _str(edit.get(key), f"verdicts[{pid}].edits[].{key}")
            for key in ("expected", "found", "foreign"):
                _str(edit.get(key), f"verdicts[{pid}].edits[].{key}", optional=True)
    for rel, sha in _obj(data.get("inputs", {}), "inputs").items():
        _source_path(rel, "input")
        _sha(sha, f"inputs[{rel}]", optional=True)
    for key, value in _obj(data.get("flashinfer", {}), "flashinfer").items():
        _expect(key in ("version", "source"), f"flashinfer has an unknown key {key!r}")
        _str(value, f"flashinfer.{key}", optional=True)
    opt_in = data.get("opt_in", [])
    _expect(
        isinstance(opt_in, list) and all(isinstance(p, str) and p in ids for p in opt_in),
        "opt_in names unknown patches",
    )
    transaction = data.get("transaction")
    if transaction is not None:
        transaction = _obj(transaction, "transaction")
        _expect(transaction.get("op") in ("apply", "revert"), f"unknown journal operation {transaction.get('op')!r}")
        for rel, move in _obj(transaction.get("files"), "transaction.files").items():
            _declared(rel, declared, "journal file")
            move = _obj(move, f"transaction.files[{rel}]")
            _sha(move.get("from"), f"transaction.files[{rel}].from")
            _sha(move.get("to"), f"transaction.files[{rel}].to")
            _expect(rel in files, f"the journal moves {rel}, which the manifest does not list")
    return data
