"""A pack on the Hugging Face Hub, judged without downloading it (``--pack hf://OWNER/NAME[@REVISION]``).

What is read, through huggingface_hub's HTTP session (the optional extra
``patch-dsv4[hub]``; every vLLM 0.34.0 environment has it), so that ``HF_TOKEN``
(or a saved token), ``HF_ENDPOINT`` (a mirror; empty means the Hub itself) and
``HF_HUB_OFFLINE`` act as for any Hub client:

1. at once, side by side: ``config.json`` and ``model.safetensors.index.json``
   at the revision named, each with one GET read to at most doctor's limit for
   the file; the answer's ``X-Repo-Commit`` names the commit, and everything
   after is read at that commit (the report names it; a file whose answer named
   another commit, the branch having moved, is read again at it);
2. the repository's top-level files and sizes at that commit (the tree listing,
   page by page, each page's JSON bounded), then, while the index is parsed, a
   HEAD of each shard: a large file (every shard) answers with a redirect to a
   CDN, whose link the ranged GETs then use directly (the token stays with the
   Hub);
3. every shard's header with ranged GETs, up to 64 at a time: one range per
   shard of the 8-byte length and the header's likely size, estimated from the
   index (the tensor names each shard holds, ``ENTRY_BYTES`` a tensor besides
   its name and the digits of its offsets, 2% and 256 bytes over), and a second request, to
   the same link, only when the header is longer. Without an index the first
   range is ``8 + FIRST_READ``. On the full-size synthetic V4.1 pack: 48 ranged
   requests, 4 second ones, 1.02 x the headers' bytes (bench/bench_doctor_hub.py).

So the reads take 4 round trips one after the other (the commit, the listing,
the CDN links, the ranges; the index's redirect, transfer and parse beside the
middle two; a fifth for a header longer than its estimate), whatever the number
of shards up to 64, where they took one per request before.

Bounds, whatever the server does: one deadline for all of it (``--hub-timeout``,
``PATCH_DSV4_HUB_TIMEOUT``; ``DEADLINE`` seconds by default), past which doctor
stops with one line; at most ``READ_LIMIT`` bytes for the pack and
``PREFETCH_BUDGET`` of headers read ahead; a listing page of at most
``LISTING_LIMIT`` bytes once decoded (a gzip bomb stops there) and at most
``MAX_PAGES`` pages; no retry and no wait on a 429 (its Retry-After is said);
names with control characters shown escaped. A server that answers a range
request with the whole file (HTTP 200), with another range than the one asked,
or with a compressed range stops doctor with a one-line error before any of
that body is read. A header longer than the Hub client's own limit
(25,000,000 bytes), a shard the listing names but the server does not have
(404), a size that disagrees with the listing, and an answer cut short are
failures of that shard, with the reason. Tensor values (the EXL3 markers) are
never read.
"""

from __future__ import annotations

import errno
import os
import queue
import re
import struct
import sys
import threading
import time
import zlib
from concurrent.futures import Future
from pathlib import Path, PurePosixPath
from urllib.parse import quote, urljoin, urlsplit

from patch_dsv4.doctor.readers.base import CONFIG_LIMIT
from patch_dsv4.doctor.readers.files import clip, shown
from patch_dsv4.doctor.readers.pack import INDEX_LIMIT
from patch_dsv4.doctor.readers.safetensors import Budget, Shard, ShardError
from patch_dsv4.doctor.readers.source import HUB_SCHEME, LocalSource, PackSource
from patch_dsv4.output.errors import EnvironmentProblem

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
COMMIT = re.compile(r"[0-9a-f]{40}")
HEADER_LIMIT = 25_000_000  # huggingface_hub's SAFETENSORS_MAX_HEADER_LENGTH: no Hub tool reads a longer header
READ_LIMIT = 512 << 20  # bytes doctor reads from the Hub for one pack (a V4.1 pack: ~14 MB of index, ~20 MB of headers)
FIRST_READ = 64 << 10  # the first range's guess at a header's length where the index gives none
FIRST_CAP = 4 << 20  # most of a header read ahead in its first range (a longer one: the rest when it is parsed)
PREFETCH_BUDGET = 64 << 20  # bytes of headers read ahead of the one being parsed
WORKERS = 64  # requests in flight at once (a DeepSeek-V4 pack has 46-50 shards: all of them)
ENTRY_BYTES = 50  # a header's bytes per tensor besides its name and the digits of its two offsets (JSON, dtype, shape)
ESTIMATE_MARGIN = 1.02
MAX_FILES = 100_000  # top-level entries of the repository doctor lists
LISTING_LIMIT = 16 << 20  # bytes of one page of the listing, decoded (a real page: ~100 KB)
MAX_PAGES = 100  # pages of the listing (a pack's top level is one)
ERROR_BODY = 64 << 10  # bytes of an error answer read to classify it
TIMEOUT = 30.0  # seconds a request may wait for the next bytes
DEADLINE = 50.0  # seconds for all of a pack's Hub reads
DEADLINE_ENV = "PATCH_DSV4_HUB_TIMEOUT"
DEFAULT_ENDPOINT = "https://huggingface.co"  # huggingface_hub's own default
CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20})$")
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"


class HubStop(EnvironmentProblem):
    """A reason to stop doctor: the Hub cannot be read as doctor must read it (one line, exit 2)."""

    def __init__(self, what: str, why: str = "", next_step: str = "") -> None:
        super().__init__(shown(what), shown(why), shown(next_step))


def install_hint() -> str:
    """The command that installs the Hub extra for the interpreter running patch-dsv4."""
    import shlex

    return f"{shlex.quote(sys.executable)} -m pip install 'patch-dsv4[hub]'"


def parse_hub_pack(text: str) -> tuple[str, str | None]:
    """``(owner/name, revision or None)`` of ``hf://OWNER/NAME[@REVISION]``; EnvironmentProblem when malformed."""
    rest = text[len(HUB_SCHEME) :]
    repo, at, revision = rest.partition("@")
    repo = repo.rstrip("/")
    bad_revision = any(c.isspace() for c in revision) or not revision.isprintable()
    if not REPO_ID.fullmatch(repo) or (at and not revision) or bad_revision:
        raise EnvironmentProblem(
            f"cannot read --pack {clip(repr(text))}",
            "a pack on the Hub is named hf://OWNER/NAME or hf://OWNER/NAME@REVISION",
            "e.g. --pack hf://MiaAI-Lab/DeepSeek-V4.1-Flash-EXL3@main",
        )
    return repo, revision or None


def hub_endpoint(environ=os.environ) -> str:
    """The endpoint to read from: ``HF_ENDPOINT``, the Hub itself where it is unset or empty (a script's
    ``HF_ENDPOINT=$MIRROR`` with no mirror); EnvironmentProblem when it is not an http(s) URL."""
    value = environ.get("HF_ENDPOINT", "").strip()
    if not value:
        return DEFAULT_ENDPOINT
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise EnvironmentProblem(
            f"HF_ENDPOINT={clip(repr(value))} is not a URL",
            "it names the Hub or a mirror of it, e.g. https://huggingface.co",
            "unset HF_ENDPOINT (doctor then reads the Hub itself; a mirror is named by its http(s):// address)",
        )
    return value.rstrip("/")


def hub_deadline(flag: float | None, environ=os.environ) -> float:
    """Seconds for all of a pack's Hub reads: ``--hub-timeout``, else ``PATCH_DSV4_HUB_TIMEOUT``, else DEADLINE."""
    if flag is not None:
        value, source = flag, "--hub-timeout"
    elif environ.get(DEADLINE_ENV, "").strip():
        source = DEADLINE_ENV
        try:
            value = float(environ[DEADLINE_ENV])
        except ValueError:
            value = float("nan")
    else:
        return DEADLINE
    if not 0 < value <= 86_400:  # NaN fails too
        shown_value = clip(repr(environ.get(DEADLINE_ENV))) if source == DEADLINE_ENV else f"{flag:g}"
        raise EnvironmentProblem(
            f"{source} {shown_value} is not a number of seconds above 0 and at most a day",
            "it bounds all of doctor's reads from the Hub",
            f"e.g. {source}{'=' if source == DEADLINE_ENV else ' '}120",
        )
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return clip(text[0] if text else type(exc).__name__)


def _digits(n: int | None) -> int:
    return len(str(n)) if n else 12


class _Pool:
    """Daemon threads running Hub requests, at most ``size``; each caller waits with its own deadline, so a
    request that never ends holds a thread, never doctor."""

    def __init__(self, size: int):
        self.size, self.jobs, self.threads, self.lock = size, queue.SimpleQueue(), 0, threading.Lock()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.jobs.put((future, fn, args))
        with self.lock:
            if self.threads < self.size:
                self.threads += 1
                threading.Thread(target=self._work, name="patch-dsv4-hub", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self.jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiter, whatever it is
                future.set_exception(exc)


_POOL: _Pool | None = None


def _pool() -> _Pool:
    global _POOL
    if _POOL is None:
        _POOL = _Pool(WORKERS)
    return _POOL


class _Fetched:
    """A top-level file as one GET read it: its bytes or why not, the commit the answer named, its last URL."""

    def __init__(self, data: bytes | None, error: OSError | None, commit: str | None):
        self.data, self.error, self.commit = data, error, commit

    @property
    def missing(self) -> bool:
        return isinstance(self.error, FileNotFoundError)


class _Late(Exception):
    """A worker's request outlived the run's deadline or a stop (its waiter has already said why)."""


class HubSource(PackSource):
    """A model repository on the Hub, read at one commit; see the module docstring."""

    remote = True
    reads_data = False

    def __init__(self, repo: str, revision: str | None, endpoint: str, token=None, *, timeout: float = DEADLINE):
        self.repo, self.revision, self.endpoint, self.token = repo, revision, endpoint.rstrip("/"), token
        self.label = f"{HUB_SCHEME}{repo}" + (f"@{revision}" if revision else "")
        self.commit: str | None = None
        self.files: dict[str, int | None] = {}  # top-level file (as the server names it) -> size, from the listing
        self.bytes_read = 0  # bytes of every body read (JSON files, listings excluded, and headers)
        self.header_bytes = 0  # of which shard headers (with their 8-byte lengths)
        self.requests = 0  # HTTP requests made, redirects followed included
        self.guess = FIRST_READ
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.stopped = False
        self._first_stop: HubStop | None = None
        self.progress = None  # a _Progress while a terminal shows it
        self._cache: dict[str, bytes | OSError] = {}
        self._shown: dict[str, str] = {}  # a shard's name as messages show it -> as the server names it
        self._ahead: dict[str, Future] = {}  # shard -> its header read ahead (prefetch_headers)
        self._located: dict[str, Future] = {}  # shard (as the server names it) -> where its bytes are (_locate)
        self._order: list[str] = []  # the shards still to be read ahead, in the scan's order
        self._estimates: dict[str, int] = {}
        self._held = 0  # bytes read ahead and not yet parsed
        self._holding: dict[str, int] = {}  # of which, each shard's
        self._lock = threading.RLock()
        self._headers_lock = threading.Lock()
        self._base_headers: dict[str, str] | None = None
        self._opening: tuple | None = None  # the first requests' futures, until ready()
        import huggingface_hub  # checked by open(): present here
        from huggingface_hub import errors, utils

        self._hub, self._errors, self._utils = huggingface_hub, errors, utils
        self._origin = self._origin_of(self.endpoint)
        utils.get_session()  # made once, here, not by the first requests racing to make it

    # ---- opening

    @classmethod
    def open(cls, text: str, timeout: float | None = None, progress: bool = False, wait: bool = True) -> HubSource:
        """The source ``hf://...`` names, its first requests made; with ``wait``, its revision resolved to a
        commit and its files listed (else at the first use of its files, or :meth:`ready`)."""
        repo, revision = parse_hub_pack(text)
        try:
            import huggingface_hub  # noqa: F401
        except ImportError:
            raise EnvironmentProblem(
                f"--pack {text} reads the pack on the Hub with huggingface_hub", "it is not installed", install_hint()
            ) from None
        source = cls(repo, revision, hub_endpoint(), timeout=hub_deadline(timeout))
        if progress:
            source.progress = _Progress.start(source)
        source._begin()
        if wait:
            source.ready()
        return source

    def ready(self) -> None:
        """Wait for the commit and the listing (raises HubStop when the Hub cannot be read); once."""
        opening, self._opening = self._opening, None
        if opening is None:
            return
        try:
            self._settle(*opening)
        except BaseException:
            self.finish()
            raise

    def _no_ranges(self, download: bool) -> str:
        """The way on from an endpoint that does not answer range requests as asked: the Hub itself, where
        HF_ENDPOINT named another; else (or too) the pack downloaded and read from disk."""
        fetch = f"hf download {self.repo} --local-dir DIR, then doctor --pack DIR"
        if self.endpoint == DEFAULT_ENDPOINT:
            return fetch
        hub = "unset HF_ENDPOINT (the Hub answers range requests as asked; this endpoint does not)"
        return f"{hub}, or {fetch}" if download else hub

    def _stop(self, why: str, next_step: str = "") -> HubStop:
        """The one-line stop; the first one made is the one said (other requests in flight then end)."""
        stop = HubStop(f"cannot read {self.label} from {self.endpoint}", why, next_step)
        with self._lock:
            self.stopped = True
            self._first_stop = self._first_stop or stop
        return stop

    def _hub_error(self, exc: Exception, what: str) -> HubStop:
        """The one-line stop for a failed request to the Hub (``what``: the file or listing asked for)."""
        errors = self._errors
        if isinstance(exc, HubStop):
            return exc
        if isinstance(exc, errors.GatedRepoError):
            return self._stop(
                f"the repository is gated and the token sent was refused or missing ({_first_line(exc)})",
                "hf auth login, with a token of an account that has accepted its terms on the Hub (or set HF_TOKEN)",
            )
        if isinstance(exc, errors.RepositoryNotFoundError):
            return self._stop(
                "no such repository, or it is private",
                "hf auth login, where it is private (or set HF_TOKEN); else check OWNER/NAME",
            )
        if isinstance(exc, errors.RevisionNotFoundError):
            return self._stop(f"no revision {self.revision!r}", "name a branch, tag or commit of the repository")
        if isinstance(exc, errors.OfflineModeIsEnabled):
            return self._stop(
                "HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE, or download the pack and pass its directory"
            )
        if isinstance(exc, errors.HfHubHTTPError):
            return self._stop(f"{what}: {_first_line(exc)}")
        if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__:
            return self._stop(f"{what}: the server sent nothing for {TIMEOUT:g} s", "check the network, or HF_ENDPOINT")
        return self._stop(f"{what}: {type(exc).__name__}: {_first_line(exc)}", "check the network, or HF_ENDPOINT")

    def _begin(self) -> None:
        """The first requests, at once: config.json and the index (and the listing, for a commit named)."""
        revision = self.revision or "main"
        config = self._submit(self._fetch_file, CONFIG_NAME, revision, CONFIG_LIMIT)
        index = self._submit(self._fetch_file, INDEX_NAME, revision, INDEX_LIMIT)
        listing = self._submit(self._list, revision) if COMMIT.fullmatch(revision) else None
        self._opening = (config, index, listing)

    def _settle(self, config: Future, index: Future, listing: Future | None) -> None:
        revision = self.revision or "main"
        first = self._wait(config, CONFIG_NAME)
        commit = first.commit
        if first.missing:  # no config.json (pack.config says so): the commit from the index, else from a shard
            commit = self._wait(index, INDEX_NAME).commit
            if self._wait(index, INDEX_NAME).missing:
                listing = listing or self._submit(self._list, revision)
                self.files = self._wait(listing, "its listing")
                shards = self._shard_names()
                commit = self._wait(self._submit(self._commit_of, shards[0]), shards[0]) if shards else None
                if commit is None:
                    return  # nothing to read at any commit: the rows say what is missing
        if not (isinstance(commit, str) and COMMIT.fullmatch(commit)):
            raise self._stop(
                f"the server does not answer as a Hugging Face Hub endpoint (no commit in X-Repo-Commit: "
                f"{clip(repr(commit))})",
                "unset HF_ENDPOINT (doctor then reads the Hub itself), or point it at a mirror of the Hub",
            )
        self.commit = commit
        if listing is None or revision != commit:
            listing = self._submit(self._list, commit)  # the listing of the very commit judged
        self.files = self._wait(listing, "its listing")
        for name in self._shard_names():  # each shard's CDN link, found while the index is parsed
            self._located[name] = self._submit(self._locate, name)
        for name, future in ((CONFIG_NAME, config), (INDEX_NAME, index)):
            fetched = self._wait(future, name)
            if fetched.commit != commit and not fetched.missing:  # the branch moved between two answers
                fetched = self._wait(self._submit(self._fetch_file, name, commit, _limit(name)), name)
            self._cache[name] = fetched.error if fetched.error is not None else fetched.data

    def finish(self) -> None:
        """Stop showing progress (the reads are over, or doctor stops)."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    # ---- requests, each in a worker thread

    def _submit(self, fn, *args) -> Future:
        return _pool().submit(fn, *args)

    def _wait(self, future: Future, what: str):
        """The result of ``future`` (its exception raised), within the run's deadline."""
        try:
            result = future.result(timeout=max(self.deadline - time.monotonic(), 0))
        except _Late:
            raise self._first_stop or self._late(what) from None
        except TimeoutError:
            if future.done():
                raise
            raise self._late(what) from None
        finally:
            if self.progress is not None:
                self.progress.update()
        return result

    def _late(self, what: str) -> HubStop:
        return self._stop(
            f"no answer within the {self.timeout:g} s doctor gives the Hub, reading {what}",
            f"on a slow link raise --hub-timeout (or {DEADLINE_ENV}); else download the pack and pass its directory",
        )

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0 or self.stopped:
            raise _Late()
        return min(left, TIMEOUT)

    @staticmethod
    def _origin_of(url: str) -> tuple[str, str]:
        parts = urlsplit(url)
        return parts.scheme, parts.netloc.lower()

    def _headers(self, url: str, extra: dict[str, str]) -> dict[str, str]:
        """huggingface_hub's headers (the token only where the endpoint's origin is), bytes as stored. They are
        built once, by the first request (huggingface_hub may ask the endpoint for its agent list then: in a
        worker, so within the deadline)."""
        with self._headers_lock:
            if self._base_headers is None:
                self._base_headers = dict(self._utils.build_hf_headers(token=self.token))
        headers = dict(self._base_headers)
        if self._origin_of(url) != self._origin:
            headers.pop("authorization", None)
            headers.pop("Authorization", None)
        headers["Accept-Encoding"] = "identity"  # sizes and ranges in bytes of the file itself
        headers.update(extra)
        return headers

    def _stream(self, url: str, extra: dict[str, str] | None = None, method: str = "GET"):
        return self._utils.get_session().stream(
            method, url, headers=self._headers(url, extra or {}), timeout=self._left()
        )

    def _count(self, response, body: int = 0, header: int = 0) -> None:
        with self._lock:
            self.requests += len(getattr(response, "history", ())) + 1
            self.bytes_read += body
            self.header_bytes += header

    def _reserve(self, size: int, name: str) -> None:
        with self._lock:
            if self.bytes_read + size > READ_LIMIT:
                raise self._stop(
                    f"reading {shown(name)} would take doctor past the {READ_LIMIT >> 20} MB it reads from the Hub "
                    f"for one pack ({self.bytes_read:,} bytes read so far)",
                    "download the pack and pass its directory",
                )

    def _raise_for(self, response, what: str) -> None:
        """A non-2xx answer as huggingface_hub classifies it (its body read, bounded), or the one-line stop for
        a 429 (doctor does not wait: it says how long the server asks)."""
        status = response.status_code
        if status == 429:
            after = clip(repr(response.headers.get("Retry-After", "unsaid")), 40)
            raise self._stop(
                f"{what}: the server refused it as too many requests (HTTP 429, Retry-After {after})",
                "wait and run doctor again; with a token (HF_TOKEN) the Hub allows more",
            )
        body = _read_body(self, response, ERROR_BODY, what, strict=False)
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-encoding", "content-length")}
        copy = type(response)(status, headers=headers, content=body, request=response.request)
        try:
            self._utils.hf_raise_for_status(copy)
        except Exception as exc:
            if isinstance(exc, self._errors.EntryNotFoundError):
                raise FileNotFoundError(errno.ENOENT, "the server has no such file (HTTP 404)") from None
            raise self._hub_error(exc, what) from None
        raise self._stop(f"{what}: HTTP {status}")

    @staticmethod
    def _commit_in(response) -> str | None:
        for answer in (*getattr(response, "history", ()), response):
            commit = answer.headers.get("X-Repo-Commit")
            if commit:
                return commit
        return None

    def _fetch_file(self, name: str, revision: str, limit: int) -> _Fetched:
        """GET a top-level file at ``revision``: its bytes (at most ``limit``) or the OSError saying why not."""
        url = self._hub.hf_hub_url(self.repo, name, revision=revision, endpoint=self.endpoint)
        self._reserve(limit, name)
        commit = None
        try:
            with self._stream(url) as response:
                self._count(response)
                commit = self._commit_in(response)
                if not 200 <= response.status_code < 300:
                    self._raise_for(response, f"GET {name}")
                data = _read_body(self, response, limit, name)
        except (HubStop, _Late):
            raise
        except OSError as exc:
            if isinstance(exc, self._errors.OfflineModeIsEnabled):  # an OSError, but no fault of the file
                raise self._hub_error(exc, f"GET {name}") from None
            return _Fetched(None, exc, commit)
        except Exception as exc:
            raise self._hub_error(exc, f"GET {name}") from None
        return _Fetched(data, None, commit)

    def _commit_of(self, name: str) -> str | None:
        """The commit a HEAD of ``name`` names (for a pack with neither config.json nor an index)."""
        url = self._hub.hf_hub_url(self.repo, name, revision=self.revision or "main", endpoint=self.endpoint)
        try:
            with self._utils.get_session().stream(
                "HEAD", url, headers=self._headers(url, {}), timeout=self._left(), follow_redirects=False
            ) as response:
                self._count(response)
                if response.status_code >= 400:
                    self._raise_for(response, f"HEAD {name}")
                return response.headers.get("X-Repo-Commit")
        except (HubStop, _Late, FileNotFoundError):
            raise
        except Exception as exc:
            raise self._hub_error(exc, f"HEAD {name}") from None

    def _locate(self, name: str) -> str | None:
        """Where the shard's bytes are: the link a HEAD of it redirects to (a CDN's, for a large file), None
        where it answers itself or cannot say (the ranged GET then goes to the Hub and says why)."""
        url = self._url(name)
        try:
            with self._utils.get_session().stream(
                "HEAD", url, headers=self._headers(url, {}), timeout=self._left(), follow_redirects=False
            ) as response:
                self._count(response)
                location = response.headers.get("Location") if 300 <= response.status_code < 400 else None
        except _Late:
            raise
        except Exception:
            return None
        return urljoin(url, location) if location else None

    def _list(self, revision: str) -> dict[str, int | None]:
        """The repository's top-level files and sizes at ``revision``, page by page (each bounded)."""
        import json

        url = f"{self.endpoint}/api/models/{self.repo}/tree/{quote(revision, safe='')}?recursive=false&expand=false"
        files: dict[str, int | None] = {}
        for page in range(1, MAX_PAGES + 1):
            try:
                with self._stream(url) as response:
                    self._count(response)
                    if not 200 <= response.status_code < 300:
                        self._raise_for(response, "listing its files")
                    body = _read_body(self, response, LISTING_LIMIT, f"the listing's page {page}", counted=False)
                    following = response.links.get("next", {}).get("url")
            except (HubStop, _Late):
                raise
            except OSError as exc:
                raise self._stop(f"listing its files: {exc.strerror or exc}") from None
            except Exception as exc:
                raise self._hub_error(exc, "listing its files") from None
            try:
                entries = json.loads(body)
            except (ValueError, RecursionError):
                entries = None
            if not isinstance(entries, list):
                raise self._stop(f"the listing's page {page} is not a JSON list of files")
            for entry in entries:
                if not isinstance(entry, dict) or entry.get("type") != "file" or not isinstance(entry.get("path"), str):
                    continue  # a folder, or what no Hub sends
                if len(files) >= MAX_FILES:
                    raise self._stop(f"the repository lists more than {MAX_FILES:,} files at its top level")
                size = entry.get("size")
                usable = isinstance(size, int) and not isinstance(size, bool) and size >= 0
                files[entry["path"]] = size if usable else None
            if not following:
                return files
            url = urljoin(url, following)
            if self._origin_of(url) != self._origin:
                raise self._stop(f"the listing's page {page} links its next page off the endpoint ({clip(url, 80)})")
        raise self._stop(f"the listing runs past {MAX_PAGES} pages (a pack's top level takes one)")

    def _shard_names(self) -> list[str]:
        return sorted(n for n in self.files if n.endswith(".safetensors") and "/" not in n)

    # ---- reads

    def read_file(self, name: str, limit: int) -> bytes:
        self.ready()
        if name not in self.files:
            raise FileNotFoundError(errno.ENOENT, f"not in the repository at commit {self.commit}")
        size = self.files[name]
        if size is not None and size > limit:
            raise OSError(errno.EFBIG, f"{size:,} bytes, more than the {limit:,} doctor reads")
        if name not in self._cache:
            fetched = self._wait(self._submit(self._fetch_file, name, self.commit or "main", limit), name)
            self._cache[name] = fetched.error if fetched.error is not None else fetched.data
        data = self._cache[name]
        if isinstance(data, OSError):
            raise data
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"more than the {limit:,} bytes doctor reads")
        if size is not None and len(data) != size:
            raise OSError(errno.EIO, f"the server's answer was cut short ({len(data):,} of {size:,} bytes)")
        return data

    def _url(self, name: str) -> str:
        return self._hub.hf_hub_url(self.repo, name, revision=self.commit or self.revision, endpoint=self.endpoint)

    def _range(self, path: PurePosixPath, start: int, stop: int, url: str | None = None):
        """Bytes ``start`` to ``stop`` (exclusive) of the shard, or fewer where it ends; the file's size as the
        server gives it; the URL that answered (a CDN's, after a redirect). Runs in a worker."""
        name = self._shown.get(path.name, path.name)
        self._reserve(stop - start, name)
        asked = f"bytes={start}-{stop - 1}"
        body, got, want, total = bytearray(), 0, 0, -1
        url = url or self._url(name)
        try:
            with self._stream(url, {"Range": asked}) as response:
                self._count(response)
                status = response.status_code
                if status == 200:
                    length = response.headers.get("Content-Length", "unknown")
                    raise self._stop(
                        f"the server ignored the Range request for {path.name} and began to send the whole file "
                        f"(HTTP 200, {clip(length, 24)} bytes): doctor reads the headers only, so it stopped before "
                        "reading any of it",
                        self._no_ranges(True),
                    )
                if status == 404:
                    raise ShardError(
                        path,
                        f"is not on the server at commit {self.commit} (HTTP 404), though the "
                        "repository's listing names it",
                    )
                if status in (401, 403):
                    raise self._stop(
                        f"HTTP {status} for {path.name}",
                        "hf auth login, with a token that may read the pack (or set HF_TOKEN)",
                    )
                if status == 429:
                    self._raise_for(response, path.name)
                if status != 206:
                    raise ShardError(path, f"cannot be read from the server (HTTP {status} for {asked})")
                encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    raise self._stop(
                        f"the server answered {asked} of {path.name} {clip(encoding, 24)}-encoded, though doctor "
                        "asked for the bytes as stored",
                        self._no_ranges(False),
                    )
                found = CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
                first, last, total = (int(x) for x in found.groups()) if found else (-1, -1, -1)
                if not found or first != start or last >= stop or last < first or last >= total:
                    raise self._stop(
                        f"the server answered {asked} of {path.name} with "
                        f"{clip(repr(response.headers.get('Content-Range')))}: not the range asked",
                        self._no_ranges(False),
                    )
                want = last - first + 1
                for chunk in response.iter_raw():
                    self._left()
                    body += chunk[: want - got]
                    got = len(body)
                    if got >= want:
                        break
                final = str(response.url)
        except (HubStop, ShardError, _Late):
            raise
        except Exception as exc:
            why = f"{type(exc).__name__}: {_first_line(exc)}"
            if got:
                why = f"the server's answer to {asked} was cut short ({got:,} of {want:,} bytes; {why})"
            raise ShardError(path, f"cannot be read from the server ({why})") from None
        finally:
            with self._lock:
                self.bytes_read += got
                self.header_bytes += got
        if got < want:
            raise ShardError(path, f"the server's answer to {asked} was cut short ({got:,} of {want:,} bytes)")
        return body, total, final

    def range(self, path: PurePosixPath, start: int, stop: int, url: str | None = None) -> tuple[bytearray, int]:
        """``_range`` from the caller's thread, within the run's deadline."""
        body, total, _ = self._wait(self._submit(self._range, path, start, stop, url), path.name)
        return body, total

    # ---- headers read ahead

    def prefetch_headers(self, weight_map: dict | None) -> None:
        """Start reading every shard's header, up to WORKERS at a time: a first range of the size the index
        (``weight_map``: tensor -> shard) gives each (see the module docstring), else ``8 + FIRST_READ``."""
        self.ready()
        names = set(self._shard_names())
        if weight_map:
            lengths: dict[str, int] = {}
            counts: dict[str, int] = {}
            for tensor, shard in weight_map.items():
                if shard in names:
                    lengths[shard] = lengths.get(shard, 0) + len(tensor)
                    counts[shard] = counts.get(shard, 0) + 1
            for shard, count in counts.items():
                per = ENTRY_BYTES + 2 * _digits(self.files.get(shard))
                self._estimates[shard] = int((lengths[shard] + count * per) * ESTIMATE_MARGIN) + 256
        self._order = [self._shown_name(n) for n in self._shard_names()]
        self._top_up(None)

    def _top_up(self, taken: str | None) -> None:
        """Read ahead the next shards while what is read ahead stays within PREFETCH_BUDGET (the shard the scan
        waits for always goes)."""
        while self._order and not self.stopped:
            name = self._order[0]
            raw = self._shown[name]
            want = min(8 + self._estimates.get(raw, self.guess), FIRST_CAP)
            size = self.files.get(raw)
            if size is not None:
                want = min(want, size)
            with self._lock:
                if self._ahead and self._held + want > PREFETCH_BUDGET and name != taken:
                    return
                self._held += want
                self._holding[name] = want
            self._order.pop(0)
            self._ahead[name] = self._submit(self._read_ahead, PurePosixPath(name), want)

    def _read_ahead(self, path: PurePosixPath, want: int):
        """A shard's first range, and the rest of its header (from where the first was redirected) when it is
        longer and the rest fits what may be read ahead."""
        raw = self._shown[path.name]
        size = self.files.get(raw)
        if size is not None and size < 8:
            return bytearray(), size
        located = self._located.get(raw)
        try:
            link = located.result(timeout=max(self.deadline - time.monotonic(), 0)) if located else None
        except TimeoutError:
            raise _Late() from None
        try:
            prefix, total, url = self._range(path, 0, max(want, 8), link)
        except ShardError:
            if link is None:
                raise
            prefix, total, url = self._range(path, 0, max(want, 8))  # the link would not serve it: the Hub
        if len(prefix) >= 8:
            end = 8 + struct.unpack("<Q", prefix[:8])[0]
            more = end - len(prefix)
            if 0 < more and end <= min(total, 8 + HEADER_LIMIT):
                with self._lock:
                    fits = self._held + more <= PREFETCH_BUDGET
                    if fits:
                        self._held += more
                        self._holding[path.name] += more
                if fits:
                    try:
                        rest, _, _ = self._range(path, len(prefix), end, url)
                    except ShardError:  # the link may not take a second request: again through the Hub
                        rest, _, _ = self._range(path, len(prefix), end)
                    prefix += rest
        return prefix, total

    def header_prefix(self, path: PurePosixPath, listed: int | None) -> tuple[bytearray, int]:
        """The first bytes of the shard (its header where it was read ahead) and its size as the server gives it."""
        future = self._ahead.pop(path.name, None)
        if future is None:
            if path.name in self._order:  # read ahead but not yet started: now
                self._top_up(path.name)
                future = self._ahead.pop(path.name, None)
        if future is None:
            want = 8 + self.guess
            if listed is not None:
                want = min(want, listed)
            return self.range(path, 0, max(want, 8))
        try:
            return self._wait(future, path.name)
        finally:
            self._release(path.name)

    def _release(self, name: str) -> None:
        """What was read ahead for the shard ``name``, parsed now (or failed): its bytes no longer held."""
        with self._lock:
            self._held -= self._holding.pop(name, 0)
        self._top_up(None)
        if self.progress is not None:
            self.progress.shard_done()

    # ---- the source interface

    def _shown_name(self, raw: str) -> str:
        name = shown(raw)
        while name in self._shown and self._shown[name] != raw:
            name += "~"
        self._shown[name] = raw
        return name

    def where(self, name: str) -> str:
        return f"{shown(name)} of {self.label}"

    def has_file(self, name: str) -> bool:
        self.ready()
        return name in self.files

    def shard_files(self) -> list[PurePosixPath]:
        self.ready()
        return [PurePosixPath(self._shown_name(name)) for name in self._shard_names()]

    def file_size(self, file) -> int | None:
        return self.files.get(self._shown.get(file.name, file.name))

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


def _limit(name: str) -> int:
    return CONFIG_LIMIT if name == CONFIG_NAME else INDEX_LIMIT


def _read_body(source: HubSource, response, limit: int, what: str, strict: bool = True, counted: bool = True) -> bytes:
    """The answer's body as stored (a gzip or deflate one decoded, a piece at a time), at most ``limit`` bytes:
    past it OSError(EFBIG) when ``strict``, else cut there. Checks the run's deadline between pieces; counts
    the bytes in ``source.bytes_read`` where ``counted`` (the listings are not: they are no file of the pack)."""
    encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
    decoder = None
    if encoding in ("gzip", "x-gzip", "deflate"):
        decoder = zlib.decompressobj(47)  # a gzip or zlib wrapper, told from its first bytes
    elif encoding not in ("", "identity"):
        if not strict:
            return b""
        raise source._stop(f"{shown(what)} came {clip(encoding, 24)}-encoded, which doctor does not decode")
    parts, got = [], 0
    try:
        for chunk in response.iter_raw():
            source._left()
            pieces = [chunk] if decoder is None else []
            if decoder is not None:
                data = decoder.decompress(chunk, limit + 1 - got)
                pieces.append(data)
                while decoder.unconsumed_tail and got + sum(map(len, pieces)) <= limit:
                    pieces.append(decoder.decompress(decoder.unconsumed_tail, limit + 1 - got - sum(map(len, pieces))))
            for piece in pieces:
                got += len(piece)
                parts.append(piece)
            if counted:
                with source._lock:
                    source.bytes_read += sum(map(len, pieces))
            if got > limit:
                if not strict:
                    return b"".join(parts)[:limit]
                raise OSError(errno.EFBIG, f"more than the {limit:,} bytes doctor reads (once decoded)")
    except zlib.error as exc:
        raise OSError(errno.EIO, f"its {encoding} encoding does not decode ({exc})") from None
    return b"".join(parts)


class _Progress:
    """What doctor has read of a Hub pack, on a terminal (rich, on stderr, cleared when done): the headers parsed,
    the requests made and the bytes read so far, read afresh at each refresh."""

    def __init__(self, source: HubSource, progress, task):
        self.source, self.progress, self.task, self.done = source, progress, task, 0

    @classmethod
    def start(cls, source: HubSource) -> _Progress | None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
        from rich.text import Text

        console = Console(stderr=True)
        if not console.is_terminal:
            return None

        class Counts(ProgressColumn):
            def render(self, task) -> Text:
                shards = f"{int(task.completed)}/{int(task.total)} headers, " if task.total else ""
                return Text(f"{shards}{source.requests} requests, {source.bytes_read / 1e6:.1f} MB")

        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            Counts(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        task = progress.add_task(f"reading {source.label}", total=None)
        progress.start()
        return cls(source, progress, task)

    def update(self) -> None:
        shards = len(self.source._shard_names())
        self.progress.update(self.task, total=shards or None, completed=self.done)

    def shard_done(self) -> None:
        self.done += 1
        self.update()

    def stop(self) -> None:
        self.progress.stop()


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
        self.prefix, total = self.source.header_prefix(self.path, listed)
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


def open_source(
    pack: str | Path, timeout: float | None = None, progress: bool = False, wait: bool = True
) -> PackSource:
    """The source ``--pack`` names: ``hf://OWNER/NAME[@REVISION]`` on the Hub (its revision resolved to a
    commit now, or with ``wait`` False at the first use of its files; raises EnvironmentProblem when that
    fails), else a local directory. ``timeout``: seconds for all of the Hub reads (None: hub_deadline's
    default); ``progress``: show them on a terminal."""
    if isinstance(pack, str) and is_hub_pack(pack):
        return HubSource.open(pack, timeout, progress, wait)
    return LocalSource(Path(pack))
