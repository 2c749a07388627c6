"""A stand-in for the Hugging Face Hub on loopback, serving pack directories (v41-packs.md §6).

It answers the requests huggingface_hub makes to read a pack without downloading
it: ``HEAD``/``GET /{repo}/resolve/{revision}/{file}`` (``ETag``, ``X-Repo-Commit``,
``Content-Length``; ``Range: bytes=a-b`` answered 206 with ``Content-Range``; a
missing file 404 with ``X-Error-Code: EntryNotFound``) and
``GET /api/models/{repo}/tree/{revision}`` (the files and their sizes). The
revision is ``main`` or the repository's commit; any other is RevisionNotFound.

As a real Hub does, it can answer each request ``delay`` seconds late (a round trip
from a serving host is 50-200 ms), and with ``cdn=True`` a GET of a large file (a
``*.safetensors``, or any file over 10 MiB: what the Hub keeps in LFS/Xet) is a
302 to a second loopback server, the "CDN", where the ranged GET must be made
again; a HEAD of such a file answers 302 with ``X-Linked-Size`` and
``X-Linked-Etag`` (``head_redirects = False``: 200, as a mirror may). The CDN
serves the bytes to anyone holding the link (it records whether an
``Authorization`` header reached it: it must not).

It counts what both send: ``bytes_sent`` (bodies), ``payload_bytes`` (bytes past a
shard's header, i.e. tensor data), ``requests`` (method, path, Range; the CDN's
paths start ``/cdn/``), ``most_in_flight`` (the most requests answered at once).
Misbehaviours are switches: ``ignore_range`` (a 200 with the whole file),
``truncate`` (file names whose ranged answers stop half-way), ``missing`` (files
listed but 404), ``wrong_range`` (a Content-Range other than the one asked),
``token`` (a gated repository: 401 GatedRepo without ``Authorization: Bearer
<token>``), and the hostile ones, each a set of request kinds (``tree``, ``head``,
``get``, ``cdn``) it applies to: ``stall`` (never answers), ``trickle`` (one byte
a second), ``rate_limit`` (429 with ``Retry-After: 100000``); with
``endless_pages`` every listing page links a next one, with ``gzip_bomb`` the
listing is 256 MB of JSON whitespace sent as 261 KB of gzip; ``extra_files``
adds names (any characters) to the listing. A stalled or trickling answer ends
when the server is shut down. Started by :func:`serving` in daemon threads, bound
to 127.0.0.1 only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import struct
import threading
import time
import zlib
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

RANGE = re.compile(r"bytes=([0-9]+)-([0-9]+)$")
CHUNK = 1 << 20
IGNORED_RANGE_CAP = 256 << 20  # what the server sends at most when it ignores Range (the client must stop far sooner)
LARGE = 10 << 20  # the Hub keeps files over 10 MiB (and every *.safetensors) in LFS/Xet storage, behind its CDN
BOMB_SIZE = 256 << 20  # bytes of the gzip bomb once decoded
GATHER_WAIT = 5.0  # seconds the CDN holds an answer for the others to arrive (gather=N)


def commit_of(repo: str) -> str:
    return hashlib.sha1(repo.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def gzip_bomb() -> bytes:
    """A JSON list of 256 MB of spaces, gzip-compressed (~261 KB), made a megabyte at a time."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [packer.compress(b"[")]
    spaces = b" " * CHUNK
    for _ in range(BOMB_SIZE // CHUNK):
        parts.append(packer.compress(spaces))
    parts.append(packer.compress(b"]"))
    parts.append(packer.flush())
    return b"".join(parts)


class StandInHub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, repos: dict[str, Path], *, delay: float = 0.0, parent: StandInHub | None = None, gather: int = 0
    ):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos = repos
        self.delay = delay
        # the CDN holds its answers until this many requests are in flight at once (or GATHER_WAIT passes), so
        # that a client asking side by side is seen to, however slowly a loaded machine starts its threads
        self.gather = gather
        self.gathered = False
        self.parent = parent  # the Hub, for the CDN: one account of what both sent
        self.cdn: StandInHub | None = None
        self.ignore_range = False
        self.wrong_range = False
        self.truncate: set[str] = set()
        self.missing: set[str] = set()
        self.token: str | None = None
        self.stall: set[str] = set()
        self.trickle: set[str] = set()
        self.rate_limit: set[str] = set()
        self.endless_pages = False
        self.gzip_bomb = False
        self.extra_files: dict[str, int] = {}  # name -> size, listed beside the repository's own files
        self.head_redirects = True  # False: a HEAD of a large file answers 200 itself (a mirror may)
        self.stopping = threading.Event()
        self.bytes_sent = 0
        self.payload_bytes = 0
        self.tree_bytes = 0  # of bytes_sent, the listings (read by huggingface_hub itself)
        self.ignored_sent = 0  # body bytes written while ignoring Range (before the client hung up)
        self.cdn_authorization = 0  # requests that reached the CDN with an Authorization header
        self.in_flight = 0  # requests being answered now, by both servers
        self.most_in_flight = 0
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range); the CDN's paths start /cdn/
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)

    def handle_error(self, request, client_address) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], OSError):  # a client that hung up is no error of the stand-in's
            super().handle_error(request, client_address)

    @property
    def hub(self) -> StandInHub:
        return self.parent or self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def count(self, sent: int, payload: int = 0) -> None:
        hub = self.hub
        with hub.lock:
            hub.bytes_sent += sent
            hub.payload_bytes += payload


def _header_end(path: Path) -> int:
    with open(path, "rb") as fh:
        head = fh.read(8)
    if len(head) < 8:
        return 0
    return 8 + struct.unpack("<Q", head)[0]


def _large(path: Path) -> bool:
    return path.name.endswith(".safetensors") or path.stat().st_size > LARGE


class _Handler(BaseHTTPRequestHandler):
    server: StandInHub
    protocol_version = "HTTP/1.1"  # keep-alive, as a real Hub and CDN answer
    _trickling = False

    def log_message(self, *args) -> None:  # quiet
        pass

    # ---- misbehaviour and delay, on every answer

    def _kind(self, parts: list[str]) -> str:
        if self.server.parent is not None:
            return "cdn"
        if len(parts) >= 5 and parts[:2] == ["api", "models"] and parts[4] == "tree":
            return "tree"
        return "head" if self.command == "HEAD" else "get"

    def _write(self, data: bytes) -> None:
        """Bytes to the client: at once, or a byte a second when trickling (until the server stops)."""
        if self._trickling:
            for i in range(len(data)):
                if self.server.hub.stopping.wait(1.0):
                    raise ConnectionAbortedError("the stand-in is shutting down")
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
        else:
            self.wfile.write(data)

    def send_response(self, code: int, message: str | None = None) -> None:
        self.send_response_only(code, message)  # no Server/Date headers: what is written is what the test set

    def end_headers(self) -> None:
        self._headers_buffer.append(b"\r\n")
        data = b"".join(self._headers_buffer)
        self._headers_buffer = []
        self._write(data)

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        headers = {**headers, "Content-Length": headers.get("Content-Length", str(len(body)))}
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if body and self.command != "HEAD":
            self._write(body)
            self.server.count(len(body))

    def _error(self, status: int, code: str, extra: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": code}).encode()
        self._send(status, {"X-Error-Code": code, "Content-Type": "application/json", **(extra or {})}, body)

    def _repo(self, owner: str, name: str) -> tuple[str, Path] | None:
        repo = f"{owner}/{name}"
        directory = self.server.hub.repos.get(repo)
        if directory is None:
            self._error(404 if self.server.hub.token is None else 401, "RepoNotFound")
            return None
        token = self.server.hub.token
        if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
            self._error(401, "GatedRepo")
            return None
        return repo, directory

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/") if p]
        hub = self.server.hub
        with hub.lock:
            hub.requests.append((self.command, url.path, self.headers.get("Range")))
            hub.in_flight += 1
            hub.most_in_flight = max(hub.most_in_flight, hub.in_flight)
            hub.arrived.notify_all()
        try:
            self._answer(url, parts)
        finally:
            with hub.lock:
                hub.in_flight -= 1

    def _answer(self, url, parts: list[str]) -> None:
        hub = self.server.hub
        kind = self._kind(parts)
        self._trickling = kind in hub.trickle
        if kind in hub.stall:
            hub.stopping.wait()  # never answers; the connection closes when the server stops
            self.close_connection = True
            return
        if hub.delay and hub.stopping.wait(hub.delay):
            self.close_connection = True
            return
        if kind == "cdn" and hub.gather:
            with hub.arrived:
                hub.gathered = hub.gathered or hub.arrived.wait_for(
                    lambda: hub.in_flight >= hub.gather or hub.stopping.is_set(), timeout=GATHER_WAIT
                )
        try:
            if kind in hub.rate_limit:
                return self._error(429, "RateLimited", {"Retry-After": "100000"})
            if kind == "cdn":
                if self.headers.get("Authorization"):
                    with hub.lock:
                        hub.cdn_authorization += 1
                return self._cdn(parts, url.query)
            if parts == ["api", "agent-harnesses"]:  # huggingface_hub's agent list (it keeps it for a day)
                return self._send(200, {"Content-Type": "application/json"}, b'{"standardEnvVars":[],"harnesses":{}}')
            if kind == "tree":
                return self._tree(parts[2], parts[3], parts[5] if len(parts) > 5 else "main", url.query)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(parts[0], parts[1], parts[3], "/".join(parts[4:]))
            self._error(404, "NotFound")
        except (ConnectionError, OSError):
            self.close_connection = True

    def _revision_ok(self, repo: str, revision: str) -> bool:
        if revision in ("main", commit_of(repo)):
            return True
        self._error(404, "RevisionNotFound")
        return False

    def _tree(self, owner: str, name: str, revision: str, query: str) -> None:
        found = self._repo(owner, name)
        if found is None or not self._revision_ok(found[0], revision):
            return
        hub = self.server.hub
        _, directory = found
        headers = {"Content-Type": "application/json"}
        if hub.gzip_bomb:
            body = gzip_bomb()
            headers["Content-Encoding"] = "gzip"
        else:
            entries = [
                {"type": "file", "path": p.name, "size": p.stat().st_size, "oid": commit_of(p.name)}
                for p in sorted(directory.iterdir())
                if p.is_file()
            ]
            entries += [
                {"type": "file", "path": n, "size": size, "oid": commit_of(n)} for n, size in hub.extra_files.items()
            ]
            page = int(query.partition("page=")[2] or 0) if "page=" in query else 0
            body = json.dumps(entries if page == 0 else []).encode()
            if hub.endless_pages:
                headers["Link"] = f'<{self.server.endpoint}{self.path.split("?")[0]}?page={page + 1}>; rel="next"'
        with hub.lock:
            hub.tree_bytes += len(body)
        self._send(200, headers, body)

    def _resolve(self, owner: str, name: str, revision: str, filename: str) -> None:
        found = self._repo(owner, name)
        if found is None or not self._revision_ok(found[0], revision):
            return
        repo, directory = found
        hub = self.server.hub
        path = directory / filename
        if filename in hub.extra_files and not path.is_file():
            return self._error(404, "EntryNotFound")
        if not path.is_file() or filename in hub.missing:
            return self._error(404, "EntryNotFound")
        size = path.stat().st_size
        etag = hashlib.sha1(filename.encode()).hexdigest()
        base = {"ETag": f'"{etag}"', "X-Repo-Commit": commit_of(repo)}
        if hub.cdn is not None and _large(path) and (self.command == "GET" or hub.head_redirects):
            location = f"{hub.cdn.endpoint}/cdn/{quote(repo)}/{commit_of(repo)}/{quote(filename)}?signed=1"
            linked = {"X-Linked-Size": str(size), "X-Linked-Etag": f'"{etag}"', "Location": location}
            return self._send(302, {**base, **linked})
        self._serve(path, filename, base)

    def _cdn(self, parts: list[str], query: str) -> None:
        """``/cdn/{owner}/{name}/{commit}/{file}?signed=1``: the bytes, to anyone with the link."""
        if len(parts) < 5 or query != "signed=1":
            return self._error(403, "AccessDenied")
        repo, commit, filename = f"{parts[1]}/{parts[2]}", parts[3], "/".join(parts[4:])
        directory = self.server.hub.repos.get(repo)
        if directory is None or commit != commit_of(repo) or not (directory / filename).is_file():
            return self._error(404, "NoSuchKey")
        self._serve(directory / filename, filename, {"ETag": f'"{hashlib.sha1(filename.encode()).hexdigest()}"'})

    def _serve(self, path: Path, filename: str, base: dict[str, str]) -> None:
        hub = self.server.hub
        size = path.stat().st_size
        wanted = RANGE.match(self.headers.get("Range", ""))
        if self.command == "HEAD":
            return self._send(200, {**base, "Content-Length": str(size), "Accept-Ranges": "bytes"})
        if wanted is None or hub.ignore_range:
            return self._whole(path, size, base)
        start, stop = int(wanted.group(1)), min(int(wanted.group(2)), size - 1)
        if start >= size:
            return self._send(416, {**base, "Content-Range": f"bytes */{size}", "Content-Length": "0"})
        length = stop - start + 1
        shown = f"bytes {start + 1 if hub.wrong_range else start}-{stop}/{size}"
        headers = {**base, "Content-Range": shown, "Content-Length": str(length), "Accept-Ranges": "bytes"}
        self.send_response(206)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if filename in hub.truncate:
            length = max(length // 2, 1)
            self.close_connection = True
        with open(path, "rb") as fh:
            data = os.pread(fh.fileno(), length, start)
        header_end = _header_end(path) if filename.endswith(".safetensors") else size
        try:
            self._write(data)
        except OSError:
            self.close_connection = True
            return
        self.server.count(len(data), max(0, start + len(data) - max(start, header_end)))

    def _whole(self, path: Path, size: int, base: dict[str, str]) -> None:
        """The whole file (a server that ignores Range, or a plain GET), sent a chunk at a time."""
        hub = self.server.hub
        self.send_response(200)
        for key, value in {**base, "Content-Length": str(size)}.items():
            self.send_header(key, value)
        self.end_headers()
        sent = 0
        with open(path, "rb") as fh:
            while sent < min(size, IGNORED_RANGE_CAP):
                data = os.pread(fh.fileno(), min(CHUNK, size - sent), sent)
                if not data:
                    break
                try:
                    self._write(data)
                except OSError:  # the client hung up
                    break
                sent += len(data)
        header_end = _header_end(path) if path.name.endswith(".safetensors") else size
        self.server.count(sent, max(0, sent - header_end))
        if hub.ignore_range:
            with hub.lock:
                hub.ignored_sent += sent
        if sent < size:
            self.close_connection = True


def _start(server: StandInHub) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return thread


@contextmanager
def serving(repos: dict[str, Path], *, delay: float = 0.0, cdn: bool = False, gather: int = 0):
    """A running stand-in Hub for ``repos`` (``owner/name`` -> directory), answering each request ``delay``
    seconds late, its large files behind a loopback CDN when ``cdn`` (holding its answers until ``gather`` are
    in flight at once, or GATHER_WAIT passes); shut down on exit (a stalled or trickling answer ends then)."""
    server = StandInHub(repos, delay=delay, gather=gather)
    servers = [server]
    if cdn:
        server.cdn = StandInHub(repos, parent=server)
        servers.append(server.cdn)
    threads = [_start(s) for s in servers]
    try:
        yield server
    finally:
        server.stopping.set()
        for s, thread in zip(servers, threads, strict=True):
            s.shutdown()
            s.server_close()
            thread.join(timeout=10)
        time.sleep(0)  # let the handlers see the stop before the caller moves on
