"""A local server speaking GitHub's releases API, and real llama.cpp release archives for it.

`ReleaseServer` answers what the control plane and the agent ask GitHub:

    GET /repos/<owner>/<repo>/releases/tags/<tag>   the release: assets with name, size,
                                                    digest ("sha256:<hex>"), browser_download_url
    GET /<owner>/<repo>/releases/download/<tag>/<name>
                                                    a 302 to /objects/<name>, as GitHub answers
    GET /objects/<name>                             the bytes

Assets are added with `add(tag, path)`; `digest_override`, `truncate` and `drop` make the faults
a real mirror or network can: a wrong digest, a body cut short, a 404.

`llama_tarball(dest, tag, server=...)` packs a real llama-server the way llama.cpp's release
does (one root directory `llama-<tag>/`). With `launcher=True` (needs `cc`) the `llama-server`
in it is a small dynamically linked launcher, as upstream's is, that needs
`libllmgw-launch.so.0` from its own directory (RUNPATH=$ORIGIN) and execs the real server beside
it: removing that library from an install is what an upgrade removing `libgomp1` does to a
real one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tarfile
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from tests.localhttp import LocalHTTP

__all__ = ["LAUNCH_LIBRARY", "ReleaseServer", "cudart_tarball", "have_cc", "llama_tarball", "sha256_of"]

LAUNCH_LIBRARY = "libllmgw-launch.so.0"

_LAUNCHER_C = r"""
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
extern int llmgw_launch_check(void);
int main(int argc, char **argv) {
    char path[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 32);
    if (n < 0) return 127;
    path[n] = 0;
    char *slash = strrchr(path, '/');
    strcpy(slash + 1, "llama-server-impl");
    if (llmgw_launch_check() != 42) return 126;
    argv[0] = path;
    execv(path, argv);
    perror("execv");
    return 127;
}
"""
_LIBRARY_C = "int llmgw_launch_check(void) { return 42; }\n"


def have_cc() -> bool:
    return shutil.which("cc") is not None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _build_launcher(work: Path) -> tuple[Path, Path]:
    work.mkdir(parents=True, exist_ok=True)
    (work / "launch.c").write_text(_LAUNCHER_C)
    (work / "lib.c").write_text(_LIBRARY_C)
    library = work / LAUNCH_LIBRARY
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(library), f"-Wl,-soname,{LAUNCH_LIBRARY}", str(work / "lib.c")],
        check=True,
    )
    launcher = work / "llama-server"
    subprocess.run(
        [
            "cc",
            "-o",
            str(launcher),
            str(work / "launch.c"),
            f"-L{work}",
            f"-l:{LAUNCH_LIBRARY}",
            "-Wl,-rpath,$ORIGIN",
        ],
        check=True,
    )
    return launcher, library


def llama_tarball(dest: Path, tag: str, *, server: Path, launcher: bool = False, name: str | None = None) -> Path:
    """A release archive of `server` named like llama.cpp's CPU build for x64 (or `name`)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / (name or f"llama-{tag}-bin-ubuntu-x64.tar.gz")
    root = f"llama-{tag}"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        folder = tarfile.TarInfo(root)
        folder.type = tarfile.DIRTYPE
        folder.mode = 0o755
        tar.addfile(folder)
        if launcher:
            built, library = _build_launcher(dest / f".build-{tag}")
            tar.add(built, f"{root}/llama-server")
            tar.add(server, f"{root}/llama-server-impl")
            tar.add(library, f"{root}/{LAUNCH_LIBRARY}")
            link = tarfile.TarInfo(f"{root}/libllmgw-launch.so")
            link.type = tarfile.SYMTYPE
            link.linkname = LAUNCH_LIBRARY
            tar.addfile(link)
        else:
            tar.add(server, f"{root}/llama-server")
        licence = dest / f".LICENSE-{tag}"
        licence.write_text("MIT\n")
        tar.add(licence, f"{root}/LICENSE")
    return archive


def cudart_tarball(dest: Path, tag: str, cuda: str) -> Path:
    """A CUDA runtime archive as the release names it (the libraries are placeholders)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / f"cudart-llama-{tag}-bin-ubuntu-cuda-{cuda}-x64.tar.gz"
    stub = dest / f".libcudart-{cuda}"
    stub.write_bytes(b"\x7fELF placeholder\n")
    with tarfile.open(archive, "w:gz") as tar:
        major = cuda.split(".")[0]
        tar.add(stub, f"libcudart.so.{major}")
        tar.add(stub, f"libcublas.so.{major}")
    return archive


class ReleaseServer:
    """GitHub's releases API and downloads, on 127.0.0.1, in a thread."""

    def __init__(self, repo: str = "ggml-org/llama.cpp", *, also: tuple[str, ...] = ()) -> None:
        self.repo = repo
        self.repos = (repo, *also)  # one API for several projects, as GitHub's is
        self.tag_repo: dict[str, str] = {}
        self.files: dict[str, Path] = {}
        self.releases: dict[str, list[str]] = {}
        self.digest_override: dict[str, str | None] = {}
        self.truncate: dict[str, int] = {}
        self.drop: set[str] = set()
        self.requests: list[str] = []
        self.http = LocalHTTP(self._request)

    def _request(self, handler: BaseHTTPRequestHandler, head: bool) -> None:
        self.requests.append(handler.path)
        self.answer(handler)

    @property
    def url(self) -> str:
        return self.http.base

    def __enter__(self) -> ReleaseServer:
        self.http.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.stop()

    def add(self, tag: str, path: Path, *, repo: str | None = None) -> None:
        self.files[path.name] = path
        self.tag_repo[tag] = repo or self.repo
        self.releases.setdefault(tag, [])
        if path.name not in self.releases[tag]:
            self.releases[tag].append(path.name)

    def release(self, tag: str) -> dict[str, Any]:
        owner_repo = self.tag_repo.get(tag, self.repo)
        assets = []
        for name in self.releases[tag]:
            path = self.files[name]
            digest = self.digest_override.get(name, "sha256:" + sha256_of(path))
            asset: dict[str, Any] = {
                "name": name,
                "size": path.stat().st_size,
                "content_type": "application/gzip",
                "browser_download_url": f"{self.url}/{owner_repo}/releases/download/{tag}/{name}",
            }
            if digest is not None:
                asset["digest"] = digest
            assets.append(asset)
        return {"tag_name": tag, "prerelease": True, "assets": assets}

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.split("?", 1)[0]
        listing = next(
            (
                path[len(f"/repos/{repo}/releases/tags/") :]
                for repo in self.repos
                if path.startswith(f"/repos/{repo}/releases/tags/")
                and self.tag_repo.get(path[len(f"/repos/{repo}/releases/tags/") :], self.repo) == repo
            ),
            None,
        )
        if listing is not None and listing in self.releases:
            body = json.dumps(self.release(listing)).encode()
            self._send(handler, 200, body, "application/json")
        elif any(path.startswith(f"/{repo}/releases/download/") for repo in self.repos):
            name = path.rsplit("/", 1)[-1]
            handler.send_response(302)
            handler.send_header("Location", f"{self.url}/objects/{name}")
            handler.send_header("Content-Length", "0")
            handler.end_headers()
        elif path.startswith("/objects/") and path[len("/objects/") :] in self.files:
            name = path[len("/objects/") :]
            if name in self.drop:
                self._send(handler, 404, b'{"message":"Not Found"}', "application/json")
                return
            path = self.files[name]
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.send_header("Content-Length", str(path.stat().st_size))
            handler.end_headers()
            cut = self.truncate.get(name)
            left = path.stat().st_size if cut is None else cut
            with open(path, "rb") as source:  # streamed, as a real server would
                while left > 0 and (chunk := source.read(min(left, 1 << 16))):
                    handler.wfile.write(chunk)
                    left -= len(chunk)
            if cut is not None:
                handler.close_connection = True
        else:
            self._send(handler, 404, b'{"message":"Not Found"}', "application/json")

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, code: int, body: bytes, kind: str) -> None:
        handler.send_response(code)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
