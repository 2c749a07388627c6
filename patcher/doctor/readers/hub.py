"""A pack on the Hugging Face Hub, judged without downloading it (``--pack hf://OWNER/NAME[@REVISION]``).

What is read, through huggingface_hub (the optional extra ``patch-dsv4[hub]``;
every vLLM 0.34.0 environment has it) and its HTTP session, so that ``HF_TOKEN``
(or a saved token), ``HF_ENDPOINT`` (a mirror) and ``HF_HUB_OFFLINE`` act as for
any Hub client:

1. ``HEAD /{repo}/resolve/{revision}/config.json``: the commit the revision
   names (``X-Repo-Commit``); everything after is read at that commit, and the
   report names it;
2. the repository's top-level files and sizes (``list_repo_tree``);
3. ``config.json`` and ``model.safetensors.index.json``, each with one GET,
   read to at most the size the listing gives and doctor's limit for the file;
4. each shard's header with HTTP range requests: one of ``8 + guess`` bytes,
   ``guess`` being the previous shard's header length (64 KiB for the first),
   and a second for the rest of the header when it is longer. So the bytes read
   are at most twice the headers' bytes plus 64 KiB, plus the JSON files.

A server that answers a range request with the whole file (HTTP 200), or with
another range than the one asked, stops doctor with a one-line error before any
of that body is read: a mirror that ignores ``Range`` would otherwise send every
shard in full. A header longer than the Hub client's own limit (25,000,000
bytes), a shard the listing names but the server does not have (404), a size
that disagrees with the listing, and an answer cut short are failures of that
shard, with the reason. Tensor values (the EXL3 markers) are never read.
"""

from __future__ import annotations

import errno
import os
import re
import struct
from pathlib import Path, PurePosixPath

from patch_dsv4.doctor.readers.files import clip
from patch_dsv4.doctor.readers.safetensors import Budget, Shard, ShardError
from patch_dsv4.doctor.readers.source import HUB_SCHEME, LocalSource, PackSource
from patch_dsv4.output.errors import EnvironmentProblem

INSTALL = "pip install 'patch-dsv4[hub]'"
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
COMMIT = re.compile(r"[0-9a-f]{40}")
HEADER_LIMIT = 25_000_000  # huggingface_hub's SAFETENSORS_MAX_HEADER_LENGTH: no Hub tool reads a longer header
READ_LIMIT = 512 << 20  # bytes doctor reads from the Hub for one pack (a V4.1 pack: ~14 MB of index, ~1 MB per header)
FIRST_READ = 64 << 10  # the first shard's guess at its header length
MAX_FILES = 100_000  # top-level entries of the repository doctor lists
TIMEOUT = 30.0  # seconds per request
CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20})$")


class HubStop(EnvironmentProblem):
    """A reason to stop doctor: the Hub cannot be read as doctor must read it (one line, exit 2)."""


def parse_hub_pack(text: str) -> tuple[str, str | None]:
    """``(owner/name, revision or None)`` of ``hf://OWNER/NAME[@REVISION]``; EnvironmentProblem when malformed."""
    rest = text[len(HUB_SCHEME) :]
    repo, at, revision = rest.partition("@")
    repo = repo.rstrip("/")
    if not REPO_ID.fullmatch(repo) or (at and not revision) or any(c.isspace() for c in revision):
        raise EnvironmentProblem(
            f"cannot read --pack {clip(repr(text))}",
            "a pack on the Hub is named hf://OWNER/NAME or hf://OWNER/NAME@REVISION",
            "e.g. --pack hf://MiaAI-Lab/DeepSeek-V4.1-Flash-EXL3@main",
        )
    return repo, revision or None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return clip(text[0] if text else type(exc).__name__)


class HubSource(PackSource):
    """A model repository on the Hub, read at one commit; see the module docstring."""

    remote = True
    reads_data = False

    def __init__(self, repo: str, revision: str | None, endpoint: str, token=None):
        self.repo, self.revision, self.endpoint, self.token = repo, revision, endpoint.rstrip("/"), token
        self.label = f"{HUB_SCHEME}{repo}" + (f"@{revision}" if revision else "")
        self.commit: str | None = None
        self.files: dict[str, int | None] = {}  # top-level file -> size, from the listing
        self.bytes_read = 0  # bytes of every body read (JSON files and headers)
        self.header_bytes = 0  # of which shard headers (with their 8-byte lengths)
        self.requests = 0
        self.guess = FIRST_READ
        self._cache: dict[str, bytes] = {}
        import huggingface_hub  # checked by open(): present here
        from huggingface_hub import errors, utils

        self._hub, self._errors, self._utils = huggingface_hub, errors, utils

    # ---- opening

    @classmethod
    def open(cls, text: str) -> HubSource:
        """The source ``hf://...`` names, its revision resolved to a commit and its files listed."""
        repo, revision = parse_hub_pack(text)
        try:
            from huggingface_hub import constants
        except ImportError:
            raise EnvironmentProblem(
                f"--pack {text} reads the pack on the Hub with huggingface_hub", "it is not installed", INSTALL
            ) from None
        endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
        source = cls(repo, revision, endpoint)
        source._resolve()
        return source

    def _stop(self, why: str, next_step: str = "") -> HubStop:
        return HubStop(f"cannot read {self.label} from {self.endpoint}", why, next_step)

    def _hub_error(self, exc: Exception, what: str) -> HubStop:
        """The one-line stop for a failed request to the Hub (``what``: the file or listing asked for)."""
        errors = self._errors
        if isinstance(exc, errors.GatedRepoError):
            return self._stop(
                f"the repository is gated and the token sent was refused or missing ({_first_line(exc)})",
                "accept its terms on the Hub, then set HF_TOKEN to a token of that account",
            )
        if isinstance(exc, errors.RepositoryNotFoundError):
            return self._stop(
                "no such repository, or it is private", "check OWNER/NAME; for a private one set HF_TOKEN"
            )
        if isinstance(exc, errors.RevisionNotFoundError):
            return self._stop(f"no revision {self.revision!r}", "name a branch, tag or commit of the repository")
        if isinstance(exc, errors.OfflineModeIsEnabled):
            return self._stop(
                "HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE, or download the pack and pass its directory"
            )
        if isinstance(exc, errors.HfHubHTTPError):
            return self._stop(f"{what}: {_first_line(exc)}")
        return self._stop(f"{what}: {type(exc).__name__}: {_first_line(exc)}", "check the network, or HF_ENDPOINT")

    def _head(self, name: str):
        """The file's metadata (commit, size), None when the repository has no such file."""
        hub = self._hub
        url = hub.hf_hub_url(self.repo, name, revision=self.revision, endpoint=self.endpoint)
        self.requests += 1
        try:
            return hub.get_hf_file_metadata(url, token=self.token, timeout=TIMEOUT, endpoint=self.endpoint)
        except self._errors.EntryNotFoundError:
            return None
        except Exception as exc:
            raise self._hub_error(exc, f"HEAD {name}") from None

    def _resolve(self) -> None:
        meta = self._head("config.json")
        if meta is None:  # no config.json: take the commit from another file (pack.config says it is missing)
            self._list(self.revision)
            others = [n for n in ("model.safetensors.index.json", *self._shard_names()) if n in self.files]
            meta = self._head(others[0]) if others else None
        commit = getattr(meta, "commit_hash", None)
        if meta is not None and not (isinstance(commit, str) and COMMIT.fullmatch(commit)):
            raise self._stop(
                f"the server does not answer as a Hugging Face Hub endpoint (no commit in X-Repo-Commit: {commit!r})",
                "point HF_ENDPOINT at a Hub or a mirror of it",
            )
        self.commit = commit
        if commit is not None:
            self._list(commit)  # the listing of the very commit judged

    def _list(self, revision: str | None) -> None:
        api = self._hub.HfApi(endpoint=self.endpoint, token=self.token)
        self.requests += 1
        files: dict[str, int | None] = {}
        try:
            for entry in api.list_repo_tree(self.repo, revision=revision, recursive=False):
                if len(files) >= MAX_FILES:
                    raise self._stop(f"the repository lists more than {MAX_FILES:,} files at its top level")
                size = getattr(entry, "size", None)
                if hasattr(entry, "blob_id"):  # a file, not a folder
                    files[entry.path] = size if isinstance(size, int) and size >= 0 else None
        except HubStop:
            raise
        except Exception as exc:
            raise self._hub_error(exc, "listing its files") from None
        self.files = files

    def _shard_names(self) -> list[str]:
        return sorted(n for n in self.files if n.endswith(".safetensors") and "/" not in n)

    # ---- reads

    def _url(self, name: str) -> str:
        return self._hub.hf_hub_url(self.repo, name, revision=self.commit or self.revision, endpoint=self.endpoint)

    def _headers(self, extra: dict[str, str]) -> dict[str, str]:
        headers = self._utils.build_hf_headers(token=self.token)
        headers["Accept-Encoding"] = "identity"  # sizes and ranges in bytes of the file itself
        headers.update(extra)
        return headers

    def _budget(self, size: int, name: str) -> None:
        if self.bytes_read + size > READ_LIMIT:
            raise self._stop(
                f"reading {name} would take doctor past the {READ_LIMIT >> 20} MB it reads from the Hub for one pack "
                f"({self.bytes_read:,} bytes read so far)",
                "download the pack and pass its directory",
            )

    def read_file(self, name: str, limit: int) -> bytes:
        if name in self._cache:
            return self._cache[name]
        if name not in self.files:
            raise FileNotFoundError(errno.ENOENT, f"not in the repository at commit {self.commit}")
        size = self.files[name]
        if size is not None and size > limit:
            raise OSError(errno.EFBIG, f"{size:,} bytes, more than the {limit:,} doctor reads")
        most = limit if size is None else size
        self._budget(most, name)
        self.requests += 1
        try:
            with self._utils.get_session().stream(
                "GET", self._url(name), headers=self._headers({}), timeout=TIMEOUT
            ) as response:
                if response.status_code == 404:
                    raise FileNotFoundError(errno.ENOENT, "the server has no such file (HTTP 404)")
                if response.status_code != 200:
                    raise OSError(errno.EIO, f"HTTP {response.status_code}")
                chunks, got = [], 0
                for chunk in response.iter_bytes():
                    got += len(chunk)
                    if got > most:
                        self.bytes_read += most
                        raise OSError(errno.EFBIG, f"the server sent more than the {most:,} bytes expected")
                    chunks.append(chunk)
        except OSError:
            raise
        except Exception as exc:
            raise OSError(errno.EIO, f"{type(exc).__name__}: {_first_line(exc)}") from None
        self.bytes_read += got
        data = b"".join(chunks)
        if size is not None and len(data) != size:
            raise OSError(errno.EIO, f"the server's answer was cut short ({len(data):,} of {size:,} bytes)")
        self._cache[name] = data
        return data

    def range(self, path: PurePosixPath, start: int, stop: int) -> tuple[bytearray, int]:
        """Bytes ``start`` to ``stop`` (exclusive) of the file, or fewer where the file ends, and the file's size
        as the server gives it. A server that does not honour the range stops doctor before reading the body."""
        name = path.name
        self._budget(stop - start, name)
        self.requests += 1
        asked = f"bytes={start}-{stop - 1}"
        body, got, want = bytearray(), 0, 0
        try:
            with self._utils.get_session().stream(
                "GET", self._url(name), headers=self._headers({"Range": asked}), timeout=TIMEOUT
            ) as response:
                status = response.status_code
                if status == 200:
                    length = response.headers.get("Content-Length", "unknown")
                    raise self._stop(
                        f"the server ignored the Range request for {name} and began to send the whole file "
                        f"(HTTP 200, {length} bytes): doctor reads the headers only, so it stopped before reading "
                        "any of it",
                        "use an endpoint that honours HTTP range requests (HF_ENDPOINT), or download the pack and "
                        "pass its directory",
                    )
                if status == 404:
                    raise ShardError(
                        path,
                        f"is not on the server at commit {self.commit} (HTTP 404), though the "
                        "repository's listing names it",
                    )
                if status in (401, 403):
                    raise self._stop(f"HTTP {status} for {name}", "set HF_TOKEN to a token with access to the pack")
                if status != 206:
                    raise ShardError(path, f"cannot be read from the server (HTTP {status} for {asked})")
                found = CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
                first, last, total = (int(x) for x in found.groups()) if found else (-1, -1, -1)
                if not found or first != start or last >= stop or last < first or last >= total:
                    raise self._stop(
                        f"the server answered {asked} of {name} with "
                        f"{clip(repr(response.headers.get('Content-Range')))}: not the range asked",
                        "use an endpoint that honours HTTP range requests (HF_ENDPOINT)",
                    )
                want = last - first + 1
                for chunk in response.iter_bytes():
                    body += chunk[: want - got]
                    got = len(body)
                    if got >= want:
                        break
        except (HubStop, ShardError):
            raise
        except Exception as exc:
            why = f"{type(exc).__name__}: {_first_line(exc)}"
            if got:
                why = f"the server's answer to {asked} was cut short ({got:,} of {want:,} bytes; {why})"
            raise ShardError(path, f"cannot be read from the server ({why})") from None
        finally:
            self.bytes_read += got
            self.header_bytes += got
        if got < want:
            raise ShardError(path, f"the server's answer to {asked} was cut short ({got:,} of {want:,} bytes)")
        return body, total

    # ---- the source interface

    def where(self, name: str) -> str:
        return f"{name} of {self.label}"

    def has_file(self, name: str) -> bool:
        return name in self.files

    def shard_files(self) -> list[PurePosixPath]:
        return [PurePosixPath(name) for name in self._shard_names()]

    def file_size(self, file) -> int | None:
        return self.files.get(file.name)

    def open_shard(self, file: PurePosixPath, budget: Budget) -> Shard:
        return HubShard(self, file, budget)

    def redownload(self) -> str:
        return f"hf download {self.repo}" + (f" --revision {self.commit}" if self.commit else "")

    def shard_fix(self, problem: ShardError) -> str:
        """The fix for a shard that cannot be used, as the repository holds it."""
        return (
            f"{problem.path.name} of {self.label} at commit {self.commit} is not usable as the server holds it; "
            "retry (a network error), else tell the pack's author and do not download this revision."
        )

    def summary(self) -> str:
        revision = self.revision or "main"
        at = f"commit {self.commit}" if self.commit else "an unresolved commit"
        return (
            f"{HUB_SCHEME}{self.repo} at {revision} = {at} ({self.endpoint}): read {self.bytes_read:,} bytes in "
            f"{self.requests} requests ({self.header_bytes:,} of them shard headers); no shard downloaded."
        )


class HubShard(Shard):
    """A shard on the Hub: its header read with range requests (see the module docstring); no data read."""

    reads_data = False

    def __init__(self, source: HubSource, path: PurePosixPath, budget: Budget):
        super().__init__(path, budget)  # type: ignore[arg-type]
        self.source = source
        self.prefix = b""

    def __enter__(self) -> HubShard:
        listed = self.source.file_size(self.path)
        if listed is not None and listed < 8:
            self.file_size = listed
            self._read_header()  # raises: shorter than the 8-byte length
        want = 8 + self.source.guess
        if listed is not None:
            want = min(want, listed)
        self.prefix, total = self.source.range(self.path, 0, want)
        if listed is not None and total != listed:
            raise ShardError(
                self.path,
                f"is {total:,} bytes on the server, but the repository's listing says {listed:,}",
                expected_size=listed,
                found_size=total,
            )
        self.file_size = total
        if len(self.prefix) >= 8:
            (header_len,) = struct.unpack("<Q", self.prefix[:8])
            if header_len <= total - 8 and header_len > HEADER_LIMIT:
                raise ShardError(
                    self.path,
                    f"header length {header_len:,} is more than doctor reads from the Hub ({HEADER_LIMIT:,} bytes, "
                    "the Hub client's own limit; a real shard's header is about 1 MB)",
                )
        try:
            self._read_header()
        finally:
            self.prefix = b""
        self.source.guess = max(self.header_len, 1)
        return self

    def close(self) -> None:
        self.tensors = {}
        self.prefix = b""

    def _pread(self, size: int, offset: int) -> bytes:
        have = len(self.prefix)
        end = min(offset + size, self.file_size)
        if end <= have:
            return self.prefix[offset:end]
        head = self.prefix[offset:have] if offset < have else b""
        start = max(offset, have)
        if start >= end:
            return head
        data, _ = self.source.range(self.path, start, end)
        if not head:
            return data
        joined = bytearray(head)
        joined += data
        return joined

    def read_i32(self, name: str) -> int:
        raise ShardError(self.path, f"tensor {name!r} is in the data, which doctor does not read from the Hub")


def is_hub_pack(text: str) -> bool:
    return text.startswith(HUB_SCHEME)


def open_source(pack: str | Path) -> PackSource:
    """The source ``--pack`` names: ``hf://OWNER/NAME[@REVISION]`` on the Hub (its revision resolved to a
    commit now; raises EnvironmentProblem when that fails), else a local directory."""
    if isinstance(pack, str) and is_hub_pack(pack):
        return HubSource.open(pack)
    return LocalSource(Path(pack))
