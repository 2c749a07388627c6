"""Where a pack's files come from: a local directory, or a model repository on the Hugging Face Hub.

Every pack check reads the pack through one :class:`PackSource`, never through
paths of its own: ``config.json`` (``DoctorContext.config``), the index
(:func:`pack.pack_index`) and each shard's header (:func:`pack.pack_scan`).
``ctx.source`` is the source; ``ctx.pack`` stays what the user named (a
``Path`` for a directory, the :class:`hub.HubSource` itself for ``hf://``), so
``str(ctx.pack)`` names the pack in messages either way.

A source offers:

- ``read_file(name, limit)``: the bytes of a top-level file, at most ``limit`` of
  them; ``FileNotFoundError`` when the pack has no such file, ``OSError`` with
  ``errno.EFBIG`` when it is longer than ``limit``, another ``OSError`` when it
  cannot be read (the contract of ``files.read_regular_file``);
- ``shard_files()``: the top-level ``*.safetensors``, sorted by name, each with a
  ``.name`` (``Path`` here, ``PurePosixPath`` on the Hub); ``OSError`` when the
  pack cannot be listed;
- ``file_size(file)``, ``has_file(name)``, ``open_shard(file, budget)`` (a
  :class:`safetensors.Shard` context manager, header validated on entry);
- ``where(name)``: how a message names one of its files;
- ``local``: the directory of a local pack, None for a remote one (checks of the
  disk itself, links and leftovers, run only where it is set);
- ``reads_data``: whether single tensor values (the EXL3 markers) may be read;
  a remote source reads headers only.
"""

from __future__ import annotations

from pathlib import Path

from patch_dsv4.doctor.readers.files import read_regular_file
from patch_dsv4.doctor.readers.safetensors import Budget, Shard

HUB_SCHEME = "hf://"


class PackSource:
    """What every source offers; see the module docstring."""

    label: str = ""
    local: Path | None = None
    reads_data: bool = True
    remote: bool = False

    def __str__(self) -> str:
        return self.label

    def where(self, name: str) -> str:
        raise NotImplementedError

    def read_file(self, name: str, limit: int) -> bytes:
        raise NotImplementedError

    def has_file(self, name: str) -> bool:
        raise NotImplementedError

    def shard_files(self) -> list:
        raise NotImplementedError

    def file_size(self, file) -> int | None:
        raise NotImplementedError

    def open_shard(self, file, budget: Budget) -> Shard:
        raise NotImplementedError

    def redownload(self) -> str:
        """The command that repairs the pack's files (for the rows' fixes)."""
        raise NotImplementedError


class LocalSource(PackSource):
    """A pack in a directory: what doctor always read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.local = self.path
        self.label = str(path)

    def where(self, name: str) -> str:
        return str(self.path / name)

    def read_file(self, name: str, limit: int) -> bytes:
        return read_regular_file(self.path / name, limit)

    def has_file(self, name: str) -> bool:
        return (self.path / name).is_file()

    def shard_files(self) -> list[Path]:
        return sorted((p for p in self.path.iterdir() if p.name.endswith(".safetensors")), key=lambda p: p.name)

    def file_size(self, file: Path) -> int | None:
        try:
            return file.stat().st_size
        except OSError:
            return None  # reported by pack.shards when the file is opened

    def open_shard(self, file: Path, budget: Budget) -> Shard:
        return Shard(file, budget)

    def redownload(self) -> str:
        import shlex

        return f"hf download <repo-id> --local-dir {shlex.quote(str(self.path))}"
