"""A local package index of ours (the PEP 503 simple API) and the wheels vLLM installs tests use.

`SimpleIndex(folder)` serves every wheel in `folder`:

    GET /simple/<project>/        links to the project's files, each with `#sha256=<hex>`
    GET /files/<name>             the bytes

The wheels are real wheels (METADATA, WHEEL, RECORD, entry points), so real uv resolves, hashes
and installs them: `engine_wheel` is a stand-in vLLM (or SGLang) whose `vllm` console script
prints its version and which depends on `torch`; `torch_wheel` is a stand-in torch whose
`torch.cuda.is_available()` is what the test says and whose arithmetic on "cuda" is done on the
CPU, because a test machine has no GPU to compute on. `uv_tarball` and `uv_wheel` pack the real
uv binary the way its GitHub release and its PyPI wheel do.
"""

from __future__ import annotations

import base64
import hashlib
import html
import re
import tarfile
import zipfile
from collections.abc import Iterable, Mapping
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from tests.engine_releases import sha256_of
from tests.localhttp import LocalHTTP

__all__ = ["SimpleIndex", "engine_wheel", "make_wheel", "torch_wheel", "uv_tarball", "uv_wheel"]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(
    dest: Path,
    name: str,
    version: str,
    files: Mapping[str, str | bytes],
    *,
    requires: Iterable[str] = (),
    scripts: Mapping[str, str] | None = None,
    tag: str = "py3-none-any",
    data_scripts: Mapping[str, bytes] | None = None,
) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    entries: dict[str, bytes] = {k: v.encode() if isinstance(v, str) else v for k, v in files.items()}
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    entries[f"{dist}.dist-info/METADATA"] = metadata.encode()
    purelib = "true" if tag == "py3-none-any" else "false"
    entries[f"{dist}.dist-info/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: llmgw-tests\nRoot-Is-Purelib: {purelib}\nTag: {tag}\n".encode()
    )
    if scripts:
        points = "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in scripts.items())
        entries[f"{dist}.dist-info/entry_points.txt"] = points.encode()
    for script, body in (data_scripts or {}).items():
        entries[f"{dist}.data/scripts/{script}"] = body
    record = [f"{path},{_record_hash(body)},{len(body)}" for path, body in entries.items()]
    record.append(f"{dist}.dist-info/RECORD,,")
    entries[f"{dist}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    path = dest / f"{dist}-{tag}.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        for member, body in entries.items():
            info = zipfile.ZipInfo(member, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if "/scripts/" in member else 0o644) << 16
            archive.writestr(info, body)
    return path


def engine_wheel(
    dest: Path, version: str, *, engine: str = "vllm", variant: str | None = None, arch: str = "x86_64"
) -> Path:
    """A stand-in vLLM or SGLang: importable, with its console script, depending on torch."""
    full = f"{version}+{variant}" if variant else version
    files = {
        f"{engine}/__init__.py": f"__version__ = {full!r}\n",
        f"{engine}/cli.py": f"import sys\n\ndef main():\n    print({engine!r}, {full!r})\n    return 0\n",
        f"{engine}/launch_server.py": "print('launch_server')\n",
    }
    tag = f"cp38-abi3-manylinux_2_28_{arch}" if variant else "py3-none-any"
    return make_wheel(dest, engine, full, files, requires=["torch"], scripts={engine: f"{engine}.cli:main"}, tag=tag)


_TORCH = """
__version__ = {version!r}


class _Version:
    cuda = {cuda!r}


version = _Version()


class _Tensor:
    def __init__(self, n, value):
        self.n, self.value = n, value

    def __matmul__(self, other):
        return _Tensor(self.n, self.value * other.value * self.n)

    def sum(self):
        return _Scalar(self.value * self.n * self.n)


class _Scalar:
    def __init__(self, value):
        self.value = value

    def item(self):
        return self.value


def ones(shape, device=None):
    if device == "cuda" and not cuda.is_available():
        raise RuntimeError("Found no NVIDIA driver on your system")
    return _Tensor(shape[0], 1.0)


class cuda:
    @staticmethod
    def is_available():
        return {available!r}

    @staticmethod
    def device_count():
        return 1 if {available!r} else 0

    @staticmethod
    def get_device_name(i):
        return "NVIDIA H100 80GB HBM3"

    @staticmethod
    def synchronize():
        pass
"""


def torch_wheel(dest: Path, version: str, *, available: bool, cuda: str | None) -> Path:
    """A stand-in torch: `cuda.is_available()` is `available`; `ones(..., device="cuda")` and a
    matmul give the numbers real torch would."""
    body = _TORCH.format(version=version, cuda=cuda, available=available)
    return make_wheel(dest, "torch", version, {"torch/__init__.py": body})


def uv_tarball(dest: Path, uv: Path, *, triple: str = "x86_64-unknown-linux-gnu") -> tuple[Path, Path]:
    """uv's release archive (root dir `uv-<triple>/` with `uv`) and its `.sha256` sidecar."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / f"uv-{triple}.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        folder = tarfile.TarInfo(f"uv-{triple}")
        folder.type = tarfile.DIRTYPE
        folder.mode = 0o755
        tar.addfile(folder)
        tar.add(uv, f"uv-{triple}/uv")
    sidecar = dest / (archive.name + ".sha256")
    sidecar.write_text(f"{sha256_of(archive)}  {archive.name}\n")
    return archive, sidecar


def uv_wheel(dest: Path, uv: Path, version: str) -> Path:
    """uv as PyPI ships it: the binary in `uv-<v>.data/scripts/uv` of a manylinux wheel."""
    return make_wheel(
        dest,
        "uv",
        version,
        {"uv/__init__.py": ""},
        tag="py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64",
        data_scripts={"uv": uv.read_bytes()},
    )


class SimpleIndex:
    """The simple API over the wheels in a folder, on 127.0.0.1, in a thread."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.requests: list[str] = []
        self.http = LocalHTTP(self._request)

    def _request(self, handler: BaseHTTPRequestHandler, head: bool) -> None:
        if not head:  # uv asks first (HEAD) whether the file server takes ranges
            self.requests.append(handler.path)
        self.answer(handler, head=head)

    @property
    def url(self) -> str:
        return self.http.base + "/simple"

    def __enter__(self) -> SimpleIndex:
        self.http.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.stop()

    @staticmethod
    def _project(filename: str) -> str:
        return filename.split("-", 1)[0].replace("_", "-").lower()

    def answer(self, handler: BaseHTTPRequestHandler, *, head: bool = False) -> None:
        path = handler.path.split("?", 1)[0]
        if path.startswith("/simple/"):
            project = path[len("/simple/") :].strip("/").lower()
            files = sorted(p for p in self.folder.glob("*.whl") if self._project(p.name) == project)
            if not files:
                self._send(handler, 404, b"not found", "text/plain")
                return
            links = "".join(
                f'<a href="/files/{html.escape(p.name)}#sha256={sha256_of(p)}">{html.escape(p.name)}</a><br>\n'
                for p in files
            )
            self._send(handler, 200, f"<!DOCTYPE html><html><body>\n{links}</body></html>".encode(), "text/html")
        elif path.startswith("/files/") and (self.folder / path[len("/files/") :]).is_file():
            body = (self.folder / path[len("/files/") :]).read_bytes()
            wanted = re.fullmatch(r"bytes=(\d*)-(\d*)", handler.headers.get("Range") or "")
            if wanted and (wanted.group(1) or wanted.group(2)):
                if wanted.group(1):
                    start = int(wanted.group(1))
                    end = min(int(wanted.group(2)), len(body) - 1) if wanted.group(2) else len(body) - 1
                else:  # the last N bytes (where a wheel's central directory is)
                    start, end = max(len(body) - int(wanted.group(2)), 0), len(body) - 1
                handler.send_response(206)
                handler.send_header("Content-Range", f"bytes {start}-{end}/{len(body)}")
                handler.send_header("Content-Length", str(end - start + 1))
                handler.end_headers()
                if not head:
                    handler.wfile.write(body[start : end + 1])
                return
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.send_header("Accept-Ranges", "bytes")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            if not head:
                handler.wfile.write(body)
        else:
            self._send(handler, 404, b"not found", "text/plain")

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, code: int, body: bytes, kind: str) -> None:
        handler.send_response(code)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
