"""A stand-in for the Hugging Face Hub on loopback, serving pack directories (v41-packs.md §6).

It answers the requests huggingface_hub makes to read a pack without downloading
it: ``HEAD``/``GET /{repo}/resolve/{revision}/{file}`` (``ETag``, ``X-Repo-Commit``,
``Content-Length``; ``Range: bytes=a-b`` answered 206 with ``Content-Range``; a
missing file 404 with ``X-Error-Code: EntryNotFound``) and
``GET /api/models/{repo}/tree/{revision}`` (the files and their sizes). The
revision is ``main`` or the repository's commit; any other is RevisionNotFound.

It counts what it sends: ``bytes_sent`` (bodies), ``payload_bytes`` (bytes past a
shard's header, i.e. tensor data), ``requests``. Misbehaviours for the hostile
cases are switches: ``ignore_range`` (a 200 with the whole file), ``truncate``
(file names whose ranged answers stop half-way), ``missing`` (files listed but
404), ``wrong_range`` (a Content-Range other than the one asked), ``token`` (a
gated repository: 401 GatedRepo without ``Authorization: Bearer <token>``).
Started by :func:`serving` in a daemon thread, bound to 127.0.0.1 only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

RANGE = re.compile(r"bytes=([0-9]+)-([0-9]+)$")
CHUNK = 1 << 20
IGNORED_RANGE_CAP = 256 << 20  # what the server sends at most when it ignores Range (the client must stop far sooner)


def commit_of(repo: str) -> str:
    return hashlib.sha1(repo.encode()).hexdigest()


class StandInHub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, repos: dict[str, Path]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos = repos
        self.ignore_range = False
        self.wrong_range = False
        self.truncate: set[str] = set()
        self.missing: set[str] = set()
        self.token: str | None = None
        self.bytes_sent = 0
        self.payload_bytes = 0
        self.tree_bytes = 0  # of bytes_sent, the listings (read by huggingface_hub itself)
        self.ignored_sent = 0  # body bytes written while ignoring Range (before the client hung up)
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def count(self, sent: int, payload: int = 0) -> None:
        with self.lock:
            self.bytes_sent += sent
            self.payload_bytes += payload


def _header_end(path: Path) -> int:
    with open(path, "rb") as fh:
        head = fh.read(8)
    if len(head) < 8:
        return 0
    return 8 + struct.unpack("<Q", head)[0]


class _Handler(BaseHTTPRequestHandler):
    server: StandInHub

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)
            self.server.count(len(body))

    def _error(self, status: int, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        self._send(
            status, {"X-Error-Code": code, "Content-Type": "application/json", "Content-Length": str(len(body))}, body
        )

    def _repo(self, owner: str, name: str) -> tuple[str, Path] | None:
        repo = f"{owner}/{name}"
        directory = self.server.repos.get(repo)
        if directory is None:
            self._error(404 if self.server.token is None else 401, "RepoNotFound")
            return None
        token = self.server.token
        if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
            self._error(401, "GatedRepo")
            return None
        return repo, directory

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/") if p]
        self.server.requests.append((self.command, url.path, self.headers.get("Range")))
        if len(parts) >= 5 and parts[:2] == ["api", "models"] and parts[4] == "tree":
            return self._tree(parts[2], parts[3], parts[5] if len(parts) > 5 else "main")
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(parts[0], parts[1], parts[3], "/".join(parts[4:]))
        self._error(404, "NotFound")

    def _revision_ok(self, repo: str, revision: str) -> bool:
        if revision in ("main", commit_of(repo)):
            return True
        self._error(404, "RevisionNotFound")
        return False

    def _tree(self, owner: str, name: str, revision: str) -> None:
        found = self._repo(owner, name)
        if found is None or not self._revision_ok(found[0], revision):
            return
        _, directory = found
        entries = [
            {"type": "file", "path": p.name, "size": p.stat().st_size, "oid": hashlib.sha1(p.name.encode()).hexdigest()}
            for p in sorted(directory.iterdir())
            if p.is_file()
        ]
        body = json.dumps(entries).encode()
        with self.server.lock:
            self.server.tree_bytes += len(body)
        self._send(200, {"Content-Type": "application/json", "Content-Length": str(len(body))}, body)

    def _resolve(self, owner: str, name: str, revision: str, filename: str) -> None:
        found = self._repo(owner, name)
        if found is None or not self._revision_ok(found[0], revision):
            return
        repo, directory = found
        path = directory / filename
        if not path.is_file() or filename in self.server.missing:
            return self._error(404, "EntryNotFound")
        size = path.stat().st_size
        base = {"ETag": f'"{hashlib.sha1(filename.encode()).hexdigest()}"', "X-Repo-Commit": commit_of(repo)}
        wanted = RANGE.match(self.headers.get("Range", ""))
        if self.command == "HEAD":
            return self._send(200, {**base, "Content-Length": str(size), "Accept-Ranges": "bytes"})
        if wanted is None or self.server.ignore_range:
            return self._whole(path, size, base)
        start, stop = int(wanted.group(1)), min(int(wanted.group(2)), size - 1)
        if start >= size:
            return self._send(416, {**base, "Content-Range": f"bytes */{size}", "Content-Length": "0"})
        length = stop - start + 1
        shown = f"bytes {start + 1 if self.server.wrong_range else start}-{stop}/{size}"
        headers = {**base, "Content-Range": shown, "Content-Length": str(length), "Accept-Ranges": "bytes"}
        self.send_response(206)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if filename in self.server.truncate:
            length = max(length // 2, 1)
        with open(path, "rb") as fh:
            data = os.pread(fh.fileno(), length, start)
        header_end = _header_end(path) if filename.endswith(".safetensors") else size
        try:
            self.wfile.write(data)
        except OSError:
            return
        self.server.count(len(data), max(0, start + len(data) - max(start, header_end)))
        if filename in self.server.truncate:
            self.close_connection = True

    def _whole(self, path: Path, size: int, base: dict[str, str]) -> None:
        """The whole file (a server that ignores Range, or a plain GET), sent a chunk at a time."""
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
                    self.wfile.write(data)
                except OSError:  # the client hung up
                    break
                sent += len(data)
        header_end = _header_end(path) if path.name.endswith(".safetensors") else size
        self.server.count(sent, max(0, sent - header_end))
        if self.server.ignore_range:
            with self.server.lock:
                self.server.ignored_sent += sent
        self.close_connection = True


@contextmanager
def serving(repos: dict[str, Path]):
    """A running stand-in Hub for ``repos`` (``owner/name`` -> directory); shut down on exit."""
    server = StandInHub(repos)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
