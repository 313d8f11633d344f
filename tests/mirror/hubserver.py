"""A local server of ours speaking the Hugging Face Hub's protocol, for repositories the tests make.

What `huggingface_hub` and the mirror ask (reference B1):

    GET  /api/models?search=&limit=&cursor=      a page of {"id", "downloads", "likes", ...};
                                                 `Link: <...>; rel="next"` for the next page
    GET  /api/models/<repo>[/revision/<rev>]      {"id", "sha", "siblings": [{"rfilename", "size",
                                                 "lfs": {"sha256", "size", "pointerSize"}}]}
    GET  /api/models/<repo>/tree/<rev>?recursive= [{"type": "file", "path", "oid", "size", "lfs"}]
    HEAD/GET /<repo>/resolve/<rev>/<path>         a small file: 200 with ETag (git sha1),
                                                 X-Repo-Commit; an LFS file: 302 to the storage
                                                 host (another port), X-Linked-Etag (sha256),
                                                 X-Linked-Size, X-Repo-Commit
    GET  /blobs/<sha256> on the storage host      the bytes, 206 to a Range request

Faults: `Repo.lie_sha256` advertises a wrong digest for a file, `HubServer.truncate[path] = n`
cuts a body after n bytes, `HubServer.change_after[path] = n` serves other bytes after n bytes
have been sent (the file changed on the Hub mid-download), and `HubServer.gone` holds
repositories that answer 404 (a repository that disappears).

A hostile Hub: `Repo.commit` may be anything (`../../tmp/x`), `HubServer.redirect[path] = url`
answers a file's resolve URL (or, for `"api"`, every API call) with a 302 to `url`,
`HubServer.unsized` lists files with no size, `HubServer.swap[path] = bytes` sends other bytes
than those listed, `HubServer.endless` sends zeros for ever with no length, and
`HubServer.pause_after[path] = n` stops after n bytes until `HubServer.go_on` is set.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.localhttp import LocalHTTP

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class Repo:
    id: str
    files: dict[str, bytes]
    commit: str = "0" * 40
    downloads: int = 0
    tags: list[str] = field(default_factory=list)
    lie_sha256: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.commit == "0" * 40:
            self.commit = hashlib.sha1(self.id.encode(), usedforsecurity=False).hexdigest()

    def lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)

    def sha256(self, path: str) -> str:
        return self.lie_sha256.get(path) or hashlib.sha256(self.files[path]).hexdigest()

    def entry(self, path: str) -> dict[str, Any]:
        data = self.files[path]
        item: dict[str, Any] = {"type": "file", "path": path, "oid": git_blob_sha1(data), "size": len(data)}
        if self.lfs(path):
            item["lfs"] = {"oid": self.sha256(path), "size": len(data), "pointerSize": 134}
        return item


class HubServer:
    def __init__(self, repos: list[Repo] | None = None, *, page_size: int = 2) -> None:
        self.repos = {r.id: r for r in repos or []}
        self.page_size = page_size
        self.truncate: dict[str, int] = {}
        self.change_after: dict[str, int] = {}
        self.gone: set[str] = set()
        self.redirect: dict[str, str] = {}
        self.unsized: set[str] = set()
        self.swap: dict[str, bytes] = {}
        self.endless: set[str] = set()
        self.pause_after: dict[str, int] = {}
        self.go_on = threading.Event()
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.api = LocalHTTP(lambda handler, head: self._answer_api(handler, head=head))
        self.storage = LocalHTTP(lambda handler, head: self._answer_storage(handler, head=head))

    @property
    def url(self) -> str:
        return self.api.base

    def add(self, repo: Repo) -> Repo:
        self.repos[repo.id] = repo
        return repo

    def __enter__(self) -> HubServer:
        self.api.start()
        self.storage.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in (self.api, self.storage):
            server.stop()

    # ------------------------------------------------------------------ answers

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, code: int, body: bytes, kind: str, head: bool, **headers: str) -> None:
        handler.send_response(code)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            handler.send_header(name.replace("_", "-"), value)
        handler.end_headers()
        if not head:
            handler.wfile.write(body)

    def _json(self, handler: BaseHTTPRequestHandler, data: Any, head: bool, **headers: str) -> None:
        self._send(handler, 200, json.dumps(data).encode(), "application/json", head, **headers)

    def _missing(self, handler: BaseHTTPRequestHandler, head: bool, **headers: str) -> None:
        self._send(handler, 404, b'{"error":"Repository not found"}', "application/json", head, **headers)

    def _repo(self, name: str) -> Repo | None:
        return None if name in self.gone else self.repos.get(name)

    def _answer_api(self, handler: BaseHTTPRequestHandler, *, head: bool) -> None:
        split = urllib.parse.urlsplit(handler.path)
        path = urllib.parse.unquote(split.path)
        query = urllib.parse.parse_qs(split.query)
        self.requests.append((handler.command, handler.path, handler.headers.get("Range")))
        if "api" in self.redirect and path.startswith("/api/"):
            return self._send(handler, 302, b"", "text/plain", head, Location=self.redirect["api"])
        if path == "/api/models":
            self._search(handler, query, head)
            return None
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path):
            repo = self._repo(match.group(1))
            if repo is None:
                return self._missing(handler, head)
            prefix = match.group(3) or ""
            items = [repo.entry(p) for p in sorted(repo.files) if p.startswith(prefix)]
            return self._json(handler, items, head)
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
            repo = self._repo(match.group(1))
            if repo is None:
                return self._missing(handler, head)
            siblings = []
            for p in sorted(repo.files):
                sibling: dict[str, Any] = {"rfilename": p, "size": len(repo.files[p]), "blobId": repo.entry(p)["oid"]}
                if p in self.unsized:
                    del sibling["size"]
                if repo.lfs(p):
                    sibling["lfs"] = {"sha256": repo.sha256(p), "size": len(repo.files[p]), "pointerSize": 134}
                siblings.append(sibling)
            info = {"id": repo.id, "sha": repo.commit, "private": False, "gated": False, "tags": repo.tags}
            info |= {"downloads": repo.downloads, "siblings": siblings, "lastModified": "2026-11-01T00:00:00.000Z"}
            return self._json(handler, info, head)
        if match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo = self._repo(match.group(1))
            if repo is None or match.group(3) not in repo.files:
                return self._missing(handler, head, X_Repo_Commit=repo.commit if repo else "")
            file = match.group(3)
            if file in self.redirect:
                return self._send(handler, 302, b"", "text/plain", head, Location=self.redirect[file])
            if file in self.endless:
                return self._endless(handler)
            data = self.swap.get(file, repo.files[file])
            common = {"X_Repo_Commit": repo.commit}
            if repo.lfs(file):
                location = f"{self.storage.base}/blobs/{repo.id}/{urllib.parse.quote(file)}"
                self._send(
                    handler,
                    302,
                    b"",
                    "text/plain",
                    head,
                    Location=location,
                    X_Linked_Etag=f'"{repo.sha256(file)}"',
                    X_Linked_Size=str(len(data)),
                    **common,
                )
                return None
            return self._bytes(handler, file, data, head, ETag=f'"{git_blob_sha1(data)}"', **common)
        return self._missing(handler, head)

    @staticmethod
    def _endless(handler: BaseHTTPRequestHandler) -> None:
        """Zeros until the client stops reading, with no length (the body ends with the connection)."""
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.close_connection = True
        zeros = bytes(2**16)
        with contextlib.suppress(OSError):
            while True:
                handler.wfile.write(zeros)

    def _search(self, handler: BaseHTTPRequestHandler, query: dict[str, list[str]], head: bool) -> None:
        words = (query.get("search") or [""])[0].lower()
        tags = query.get("filter") or []
        found = [r for r in sorted(self.repos.values(), key=lambda r: -r.downloads) if words in r.id.lower()]
        found = [r for r in found if all(t in r.tags for t in tags)]
        found = [r for r in found if r.id not in self.gone]
        limit = int((query.get("limit") or [str(self.page_size)])[0])
        size = min(limit, self.page_size)
        start = int((query.get("cursor") or ["0"])[0])
        page = found[start : start + size]
        headers = {}
        if start + size < len(found) and start + size < limit:
            params = {k: v[0] for k, v in query.items()} | {"cursor": str(start + size)}
            headers["Link"] = f'<{self.url}/api/models?{urllib.parse.urlencode(params)}>; rel="next"'
        items = [{"id": r.id, "downloads": r.downloads, "likes": 0, "tags": r.tags, "private": False} for r in page]
        self._json(handler, items, head, **headers)

    def _answer_storage(self, handler: BaseHTTPRequestHandler, *, head: bool) -> None:
        self.requests.append(("STORAGE " + handler.command, handler.path, handler.headers.get("Range")))
        if "Authorization" in handler.headers:  # the Hub's storage refuses a token meant for the Hub
            return self._send(handler, 400, b"Authorization is not accepted here", "text/plain", head)
        match = re.fullmatch(r"/blobs/([^/]+/[^/]+)/(.+)", urllib.parse.unquote(handler.path))
        repo = self._repo(match.group(1)) if match else None
        if repo is None or match is None or match.group(2) not in repo.files:
            return self._missing(handler, head)
        file = match.group(2)
        return self._bytes(handler, file, self.swap.get(file, repo.files[file]), head, ETag=f'"{repo.sha256(file)}"')

    def _bytes(self, handler: BaseHTTPRequestHandler, name: str, data: bytes, head: bool, **headers: str) -> None:
        size = len(data)
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", handler.headers.get("Range") or "")
        start, end, code = 0, size - 1, 200
        if wanted:
            start = int(wanted.group(1))
            end = min(int(wanted.group(2)) if wanted.group(2) else size - 1, size - 1)
            if start >= size:
                self._send(handler, 416, b"", "text/plain", head, Content_Range=f"bytes */{size}")
                return
            code = 206
        handler.send_response(code)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Content-Length", str(end - start + 1))
        handler.send_header("Accept-Ranges", "bytes")
        if code == 206:
            handler.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        for key, value in headers.items():
            handler.send_header(key.replace("_", "-"), value)
        handler.end_headers()
        if head:
            return
        body = data[start : end + 1]
        changed = self.change_after.get(name)
        if changed is not None and start + len(body) > changed:
            cut = max(changed - start, 0)
            body = body[:cut] + bytes(b ^ 0x5A for b in body[cut:])
        cut_at = self.truncate.get(name)
        if cut_at is not None and start + len(body) > cut_at:
            body = body[: max(cut_at - start, 0)]
            handler.close_connection = True
        pause = self.pause_after.get(name)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if pause is not None and start < pause < start + len(body):
                handler.wfile.write(body[: pause - start])
                handler.wfile.flush()
                self.go_on.wait(60)
                body = body[pause - start :]
            handler.wfile.write(body)
