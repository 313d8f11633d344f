"""apps.gateway.upstream through HTTP proxies and with a CA bundle, against real sockets.

The proxy is written here (asyncio): it opens CONNECT tunnels, forwards absolute-form requests,
can insist on credentials, and keeps every request head it read. Behind it is the scripted server
of test_upstream, speaking TLS with a certificate signed by a CA made for the test. The proxy looks
target names up in its own table, so `provider.test` — a name nothing here can resolve — reaches
127.0.0.1 the way an internet provider's name reaches the provider: only through the proxy.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import ipaddress
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pytest

from apps.gateway.upstream import ConnectError, Pool, Proxy, ProxyConfig
from tests.gateway.mock_engine import closed_port
from tests.gateway.test_upstream import WAIT, Server, answer, keep_alive

PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY", "REQUEST_METHOD")


@pytest.fixture(autouse=True)
def _no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's own proxy settings must not decide where these tests' requests go."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


# A test CA and a provider certificate it signed -------------------------------------------------------


@dataclass
class Pki:
    ca_file: Path
    cert_file: Path
    key_file: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def make_pki(folder: Path) -> Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)

    def usage(*, ca: bool) -> x509.KeyUsage:
        return x509.KeyUsage(
            digital_signature=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=ca,
            crl_sign=ca,
            encipher_only=False,
            decipher_only=False,
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmgw test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP256R1())
    names = [
        x509.DNSName("provider.test"),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "provider.test")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    pki = Pki(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    pki.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pki.key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return pki


# The proxy -------------------------------------------------------------------------------------------


class LocalProxy:
    """CONNECT tunnels and absolute-form forwarding, as an organisation's HTTP proxy does them."""

    def __init__(
        self, *, credentials: tuple[str, str] | None = None, refuse: bytes | None = None, hang_up: bool = False
    ) -> None:
        self.required = None
        if credentials is not None:
            self.required = "Basic " + base64.b64encode(":".join(credentials).encode()).decode()
        self.refuse = refuse  # a status (b"403 Forbidden") to answer every request with
        self.hang_up = hang_up  # close every connection as soon as a request head arrived
        self.names = {"provider.test": "127.0.0.1"}
        self.connections = 0
        self.heads: list[bytes] = []
        self.connects: list[str] = []
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> LocalProxy:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_with(self, user: str, password: str) -> str:
        return f"http://{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:{self.port}"

    def seen(self, name: str) -> list[str]:
        """The values of one header over every request head the proxy read."""
        found = []
        for head in self.heads:
            for line in head.decode("latin-1").split("\r\n")[1:]:
                key, _, value = line.partition(":")
                if key.strip().lower() == name.lower():
                    found.append(value.strip())
        return found

    async def _open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(self.names.get(host, host), port)
        self.writers.append(writer)
        return reader, writer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            await self._requests(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            self.heads.append(head)
            if self.hang_up:
                return
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            if self.refuse is not None or (self.required and headers.get("proxy-authorization") != self.required):
                status = self.refuse or b"407 Proxy Authentication Required"
                writer.write(
                    b'HTTP/1.1 %s\r\nProxy-Authenticate: Basic realm="test"\r\nContent-Length: 0\r\n'
                    b"Connection: close\r\n\r\n" % status
                )
                await writer.drain()
                return
            if method == "CONNECT":
                self.connects.append(target)
                host, _, port = target.rpartition(":")
                up_reader, up_writer = await self._open(host.strip("[]"), int(port))
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await writer.drain()
                await relay(reader, writer, up_reader, up_writer)
                return
            # An absolute-form request: forwarded in origin form, its answer (with a length) sent back.
            url = urlsplit(target)
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if upstream is None:
                upstream = await self._open(url.hostname or "", url.port or 80)
            up_reader, up_writer = upstream
            path = (url.path or "/") + (f"?{url.query}" if url.query else "")
            kept = [line for line in lines[1:] if line and not line.lower().startswith("proxy-authorization:")]
            up_writer.write("\r\n".join([f"{method} {path} HTTP/1.1", *kept, "", ""]).encode("latin-1") + body)
            answer_head = await up_reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in answer_head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            writer.write(answer_head + await up_reader.readexactly(length))
            await writer.drain()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for writer in self.writers:
                writer.transport.abort()
            await self.server.wait_closed()


async def relay(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
) -> None:
    """Bytes both ways until either side closes: the tunnel, which sees only TLS records."""

    async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        except OSError:
            pass
        finally:
            sink.close()

    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


# Fixtures --------------------------------------------------------------------------------------------


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest.fixture
async def started() -> AsyncIterator[Callable[[Any], Awaitable[Any]]]:
    """Starts servers and proxies, and stops each at the end."""
    running: list[Server | LocalProxy] = []

    async def start(thing: Any) -> Any:
        running.append(thing)
        return await thing.start()

    yield start
    for thing in running:
        await thing.stop()


@pytest.fixture
async def pools() -> AsyncIterator[Callable[..., Pool]]:
    made: list[Pool] = []

    def make(**kwargs: Any) -> Pool:
        pool = Pool(connect_timeout=WAIT, read_timeout=WAIT, **kwargs)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        await pool.close()


async def tls_server(start: Callable[[Any], Awaitable[Any]], pki: Pki, handler: Any = keep_alive) -> Server:
    server = Server(handler)
    running: Server = await start(_TlsStart(server, pki.server_context()))
    return running


class _TlsStart:
    """A Server started with TLS through the `started` fixture."""

    def __init__(self, server: Server, context: ssl.SSLContext) -> None:
        self.server = server
        self.context = context

    async def start(self) -> Server:
        return await self.server.start(self.context)

    async def stop(self) -> None:
        await self.server.stop()


def provider(server: Server) -> str:
    return f"https://provider.test:{server.port}/v1/chat/completions"


# https through the proxy -----------------------------------------------------------------------------


async def test_https_goes_through_a_connect_tunnel_and_is_verified_with_the_ca_bundle(
    started: Any, pools: Callable[..., Pool], pki: Pki
) -> None:
    server = await tls_server(started, pki)
    proxy: LocalProxy = await started(LocalProxy())
    pool = pools(proxies=ProxyConfig(https=proxy.url), ca_bundle=str(pki.ca_file))
    async with await pool.post(provider(server), b'{"model": "m"}', [("Authorization", "Bearer s")]) as response:
        assert response.status == 200
        assert await response.read() == b'{"echo": 14}'
    assert proxy.connects == [f"provider.test:{server.port}"]
    connect = proxy.heads[0].decode().split("\r\n")
    assert connect[0] == f"CONNECT provider.test:{server.port} HTTP/1.1"
    assert f"Host: provider.test:{server.port}" in connect
    assert proxy.seen("proxy-authorization") == []
    head = server.requests[0][0].decode().split("\r\n")  # what the provider saw inside the tunnel
    assert head[0] == "POST /v1/chat/completions HTTP/1.1"
    assert f"Host: provider.test:{server.port}" in head
    assert "Authorization: Bearer s" in head


async def test_the_same_tunnel_without_the_bundle_is_refused_as_untrusted(
    started: Any, pools: Callable[..., Pool], pki: Pki
) -> None:
    server = await tls_server(started, pki)
    proxy: LocalProxy = await started(LocalProxy())
    pool = pools(proxies=ProxyConfig(https=proxy.url))  # the system store, which does not know the test CA
    with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED") as caught:
        await pool.post(provider(server), b"{}")
    assert f"provider.test:{server.port} through the proxy {proxy.url}" in str(caught.value)
    assert server.requests == []


async def test_proxy_credentials_go_to_the_proxy_as_basic_authorization_and_not_to_the_provider(
    started: Any, pools: Callable[..., Pool], pki: Pki
) -> None:
    server = await tls_server(started, pki)
    proxy: LocalProxy = await started(LocalProxy(credentials=("gateway", "p@ss:word")))
    pool = pools(proxies=ProxyConfig(https=proxy.url_with("gateway", "p@ss:word")), ca_bundle=str(pki.ca_file))
    async with await pool.post(provider(server), b"{}") as response:
        assert response.status == 200
    assert proxy.seen("proxy-authorization") == ["Basic " + base64.b64encode(b"gateway:p@ss:word").decode()]
    assert b"proxy-authorization" not in server.requests[0][0].lower()


async def test_a_proxy_that_wants_other_credentials_is_a_connect_error_with_its_407(
    started: Any, pools: Callable[..., Pool], pki: Pki
) -> None:
    server = await tls_server(started, pki)
    proxy: LocalProxy = await started(LocalProxy(credentials=("gateway", "right")))
    for url in (proxy.url, proxy.url_with("gateway", "wrong-secret")):
        pool = pools(proxies=ProxyConfig(https=url), ca_bundle=str(pki.ca_file))
        with pytest.raises(ConnectError) as caught:
            await pool.post(provider(server), b"{}")
        message = str(caught.value)
        assert message == (
            f"the proxy {proxy.url} refused the tunnel to provider.test:{server.port}: "
            "HTTP/1.1 407 Proxy Authentication Required"
        )
        assert "wrong-secret" not in message
    assert server.connections == 0


async def test_a_proxy_that_refuses_the_tunnel_or_hangs_up_is_a_connect_error_naming_it(
    started: Any, pools: Callable[..., Pool], pki: Pki
) -> None:
    server = await tls_server(started, pki)
    refusing: LocalProxy = await started(LocalProxy(refuse=b"403 Forbidden"))
    pool = pools(proxies=ProxyConfig(https=refusing.url), ca_bundle=str(pki.ca_file))
    with pytest.raises(
        ConnectError,
        match=f"the proxy {refusing.url} refused the tunnel to provider.test:{server.port}: HTTP/1.1 403 Forbidden",
    ):
        await pool.post(provider(server), b"{}")
    hanging_up: LocalProxy = await started(LocalProxy(hang_up=True))
    pool = pools(proxies=ProxyConfig(https=hanging_up.url), ca_bundle=str(pki.ca_file))
    with pytest.raises(
        ConnectError,
        match=f"the proxy {hanging_up.url} closed the connection before answering CONNECT provider.test:{server.port}",
    ):
        await pool.post(provider(server), b"{}")


async def test_a_proxy_that_is_down_is_a_connect_error_naming_the_proxy(pools: Callable[..., Pool]) -> None:
    port = closed_port()
    pool = pools(proxies=ProxyConfig(http=f"http://127.0.0.1:{port}", https=f"http://127.0.0.1:{port}"))
    for url, target in (
        ("https://provider.test/v1/chat/completions", "provider.test"),
        ("http://provider.test:8000/v1/chat/completions", "provider.test:8000"),
    ):
        with pytest.raises(
            ConnectError, match=f"could not connect to the proxy http://127.0.0.1:{port} for {target}: "
        ):
            await pool.post(url, b"{}")


async def test_connections_through_the_proxy_are_kept_and_reused(
    started: Any, pools: Callable[..., Pool], pki: Pki
) -> None:
    server = await tls_server(started, pki)
    proxy: LocalProxy = await started(LocalProxy())
    pool = pools(proxies=ProxyConfig(https=proxy.url), ca_bundle=str(pki.ca_file))
    for _ in range(2):
        async with await pool.post(provider(server), b"{}") as response:
            assert await response.read() == b'{"echo": 2}'
    assert proxy.connects == [f"provider.test:{server.port}"]  # one tunnel for both
    assert server.connections == 1
    assert pool.idle_count() == 1


async def test_a_tunnelled_connection_the_provider_closed_while_idle_is_dropped(
    started: Any, pools: Callable[..., Pool], pki: Pki
) -> None:
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(answer(b"{}"))
        await writer.drain()

    server = await tls_server(started, pki, one_then_close)
    proxy: LocalProxy = await started(LocalProxy())
    pool = pools(proxies=ProxyConfig(https=proxy.url), ca_bundle=str(pki.ca_file))
    async with await pool.post(provider(server), b"{}") as response:
        await response.read()
    async with asyncio.timeout(WAIT):  # the close travels back through the tunnel and TLS to the pool
        while pool.idle_count():
            await asyncio.sleep(0.005)
    async with await pool.post(provider(server), b"{}") as response:
        assert await response.read() == b"{}"
    assert len(proxy.connects) == 2


async def test_a_stream_arrives_chunk_by_chunk_through_the_tunnel(
    started: Any, pools: Callable[..., Pool], pki: Pki
) -> None:
    proceed = asyncio.Event()

    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while await server.read_request(reader) is not None:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                b"d\r\ndata: first\n\n\r\n"
            )
            await writer.drain()
            await proceed.wait()
            writer.write(b"e\r\ndata: second\n\n\r\n0\r\n\r\n")
            await writer.drain()
            proceed.clear()

    server = await tls_server(started, pki, chunked)
    proxy: LocalProxy = await started(LocalProxy())
    pool = pools(proxies=ProxyConfig(https=proxy.url), ca_bundle=str(pki.ca_file))
    async with await pool.post(provider(server), b"{}") as response:
        assert response.headers["content-type"] == "text/event-stream"
        chunks = response.iter_chunks()
        assert await anext(chunks) == b"data: first\n\n"  # before the rest was even written
        proceed.set()
        assert [c async for c in chunks] == [b"data: second\n\n"]
    assert pool.idle_count() == 1


# http through the proxy ------------------------------------------------------------------------------


async def test_http_goes_to_the_proxy_in_absolute_form_with_its_credentials(
    started: Any, pools: Callable[..., Pool]
) -> None:
    server: Server = await started(Server(keep_alive))
    proxy: LocalProxy = await started(LocalProxy(credentials=("gateway", "s3cret")))
    pool = pools(proxies=ProxyConfig(http=proxy.url_with("gateway", "s3cret")))
    url = f"http://provider.test:{server.port}/v1/chat/completions?trace=1"
    for _ in range(2):
        async with await pool.post(url, b'{"model": "m"}') as response:
            assert response.status == 200
            assert await response.read() == b'{"echo": 14}'
    head = proxy.heads[0].decode().split("\r\n")
    assert head[0] == f"POST http://provider.test:{server.port}/v1/chat/completions?trace=1 HTTP/1.1"
    assert f"Host: provider.test:{server.port}" in head
    assert f"Proxy-Authorization: Basic {base64.b64encode(b'gateway:s3cret').decode()}" in head
    assert proxy.connects == []
    assert proxy.connections == 1  # kept alive between the two
    assert len(proxy.heads) == 2
    assert server.requests[0][0].split(b"\r\n")[0] == b"POST /v1/chat/completions?trace=1 HTTP/1.1"


async def test_a_407_from_the_proxy_for_http_is_a_connect_error_not_the_providers_answer(
    started: Any, pools: Callable[..., Pool]
) -> None:
    server: Server = await started(Server(keep_alive))
    proxy: LocalProxy = await started(LocalProxy(credentials=("gateway", "s3cret")))
    pool = pools(proxies=ProxyConfig(http=proxy.url))
    with pytest.raises(
        ConnectError, match=f"the proxy {proxy.url} refused the request: 407 Proxy Authentication Required"
    ):
        await pool.post(f"http://provider.test:{server.port}/v1/chat/completions", b"{}")
    assert pool.idle_count() == 0
    assert server.connections == 0


async def test_http_and_https_targets_each_use_their_own_proxy(
    started: Any, pools: Callable[..., Pool], pki: Pki
) -> None:
    plain: Server = await started(Server(keep_alive))
    secure = await tls_server(started, pki)
    for_http: LocalProxy = await started(LocalProxy())
    for_https: LocalProxy = await started(LocalProxy())
    pool = pools(proxies=ProxyConfig(http=for_http.url, https=for_https.url), ca_bundle=str(pki.ca_file))
    for url in (f"http://provider.test:{plain.port}/v1/chat/completions", provider(secure)):
        async with await pool.post(url, b"{}") as response:
            assert await response.read() == b'{"echo": 2}'
    assert [h.split(b" ")[0] for h in for_http.heads] == [b"POST"]
    assert for_https.connects == [f"provider.test:{secure.port}"]


# Which targets bypass the proxy ----------------------------------------------------------------------


async def test_loopback_targets_are_never_proxied_by_default(started: Any, pools: Callable[..., Pool]) -> None:
    server: Server = await started(Server(keep_alive))
    proxy: LocalProxy = await started(LocalProxy())
    pool = pools(proxies=ProxyConfig(http=proxy.url, https=proxy.url))
    for host in ("127.0.0.1", "localhost"):
        async with await pool.post(f"http://{host}:{server.port}/v1/chat/completions", b"{}") as response:
            assert response.status == 200
    assert proxy.connections == 0
    assert len(server.requests) == 2


@pytest.mark.parametrize(
    ("no_proxy", "host"),
    [
        ("127.0.0.1", "127.0.0.1"),  # an exact address
        ("10.0.0.0/8, 127.0.0.0/8", "127.0.0.1"),  # a CIDR range, among others
        ("*", "127.0.0.1"),  # everything
        ("example.com,localhost", "localhost"),  # an exact name
        (".localhost", "localhost"),  # a suffix with its leading dot matches the name itself
        ("127.0.0.1:{port}", "127.0.0.1"),  # this host on this port
    ],
)
async def test_no_proxy_sends_a_listed_target_directly(
    started: Any, pools: Callable[..., Pool], no_proxy: str, host: str
) -> None:
    server: Server = await started(Server(keep_alive))
    proxy: LocalProxy = await started(LocalProxy())
    # The proxy may reach loopback here, so loopback is not exempt by itself and NO_PROXY alone decides.
    config = ProxyConfig(http=proxy.url, no_proxy=no_proxy.format(port=server.port), proxy_loopback=True)
    pool = pools(proxies=config)
    async with await pool.post(f"http://{host}:{server.port}/v1/chat/completions", b"{}") as response:
        assert response.status == 200
    assert proxy.connections == 0
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    ("no_proxy", "host"),
    [
        ("10.0.0.0/8,192.168.0.1", "127.0.0.1"),
        ("127.0.0.1:{other}", "127.0.0.1"),
        ("notlocalhost,host.localhost", "localhost"),
        ("", "localhost"),
    ],
)
async def test_a_target_no_proxy_does_not_list_goes_through_the_proxy(
    started: Any, pools: Callable[..., Pool], no_proxy: str, host: str
) -> None:
    server: Server = await started(Server(keep_alive))
    proxy: LocalProxy = await started(LocalProxy())
    config = ProxyConfig(http=proxy.url, no_proxy=no_proxy.format(other=server.port + 1), proxy_loopback=True)
    pool = pools(proxies=config)
    async with await pool.post(f"http://{host}:{server.port}/v1/chat/completions", b"{}") as response:
        assert response.status == 200
    assert proxy.connections == 1
    assert proxy.heads[0].startswith(f"POST http://{host}:{server.port}/".encode())


@pytest.mark.parametrize(
    ("no_proxy", "host", "port", "bypassed"),
    [
        ("example.com", "example.com", 443, True),
        ("example.com", "api.example.com", 443, True),
        (".example.com", "example.com", 443, True),
        (".example.com", "deep.api.example.com", 443, True),
        ("*.example.com", "api.example.com", 443, True),
        ("example.com", "notexample.com", 443, False),
        ("example.com", "example.com.evil.net", 443, False),
        ("EXAMPLE.com", "Example.COM.", 443, True),  # case and a trailing dot do not matter
        ("example.com:8443", "api.example.com", 8443, True),
        ("example.com:8443", "api.example.com", 443, False),
        ("10.0.0.0/8", "10.20.30.40", 8000, True),
        ("10.0.0.0/8", "11.0.0.1", 8000, False),
        ("10.1.2.3", "10.1.2.3", 8000, True),
        ("10.1.2.3", "10.1.2.4", 8000, False),
        ("10.1.2.3:8000", "10.1.2.3", 8001, False),
        ("0.0.1", "10.0.0.1", 80, False),  # names match names, not the text of an address
        ("fd00::/8", "fd12::1", 8000, True),
        ("::1,fd12::1", "fd12::1", 8000, True),
        ("[fd12::1]:8000", "fd12::1", 8000, True),
        ("[fd12::1]:8000", "fd12::1", 9000, False),
        ("*", "api.openai.com", 443, True),
        ("a.com,,  b.com ,c.com", "b.com", 443, True),  # empty entries and spaces
        ("bad:port, [broken", "bad", 443, False),  # unreadable entries match nothing
        ("", "localhost", 443, True),  # loopback, always
        ("", "api.localhost", 443, True),
        ("", "127.0.0.53", 443, True),
        ("", "::1", 443, True),
        ("", "::ffff:127.0.0.1", 443, True),
        ("", "10.0.0.1", 443, False),  # private addresses only when listed
    ],
)
def test_no_proxy_rules(no_proxy: str, host: str, port: int, bypassed: bool) -> None:
    config = ProxyConfig(https="http://proxy.example:3128", no_proxy=no_proxy)
    assert config.bypasses(host, port) is bypassed
    assert (config.select(True, host, port) is None) is bypassed


def test_a_proxy_url_is_read_as_curl_reads_it_and_shown_without_its_password() -> None:
    assert Proxy.parse("proxy.example:3128") == Proxy("proxy.example", 3128, None)
    assert Proxy.parse("http://proxy.example") == Proxy("proxy.example", 80, None)
    with_credentials = Proxy.parse("http://gate%20way:p%40ss@proxy.example:8080/")
    assert with_credentials.authorization == "Basic " + base64.b64encode(b"gate way:p@ss").decode()
    assert with_credentials.url == "http://proxy.example:8080"
    assert Proxy.parse("http://[fd00::1]:3128").url == "http://[fd00::1]:3128"
    assert "p@ss" not in repr(ProxyConfig(https="http://u:p@ss@proxy.example:1"))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://u:topsecret@proxy.example:443", "https:// proxy"),
        ("socks5://proxy.example:1080", "socks5:// is not supported"),
        ("http://proxy.example:99999", "invalid port"),
        ("http://:3128", "names no host"),
    ],
)
def test_a_proxy_this_client_cannot_use_is_refused_when_the_pool_is_made(
    monkeypatch: pytest.MonkeyPatch, url: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        ProxyConfig(https=url)
    assert "topsecret" not in str(caught.value)
    monkeypatch.setenv("HTTPS_PROXY", url)
    with pytest.raises(ValueError, match=message):
        Pool()


def test_the_environment_names_the_proxies_lower_case_first() -> None:
    config = ProxyConfig.from_env(
        {
            "HTTPS_PROXY": "http://upper:1",
            "https_proxy": "http://lower:2",
            "HTTP_PROXY": "http://plain:3",
            "NO_PROXY": "10.0.0.0/8",
            "no_proxy": "a.test",
        }
    )
    assert config.https == Proxy("lower", 2)
    assert config.http == Proxy("plain", 3)
    assert config.no_proxy == "a.test"
    assert config.select(True, "b.a.test", 443) is None
    assert config.select(True, "10.0.0.1", 443) == Proxy("lower", 2)
    assert config.select(False, "api.example", 80) == Proxy("plain", 3)
    empty = ProxyConfig.from_env({"HTTPS_PROXY": "", "http_proxy": "  "})
    assert not empty and empty.select(True, "api.example", 443) is None
    # Under CGI a client's "Proxy:" header would arrive as HTTP_PROXY: it is not trusted there.
    assert ProxyConfig.from_env({"HTTP_PROXY": "http://injected:1", "REQUEST_METHOD": "POST"}).http is None
    assert ProxyConfig().for_url("https://api.example/v1") is None


async def test_a_pool_reads_the_environment_once_when_it_is_made(
    started: Any, pools: Callable[..., Pool], pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await tls_server(started, pki)
    proxy: LocalProxy = await started(LocalProxy())
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    pool = pools(ca_bundle=str(pki.ca_file))
    monkeypatch.delenv("HTTPS_PROXY")
    assert pool.proxies.https == Proxy("127.0.0.1", proxy.port)
    async with await pool.post(provider(server), b"{}") as response:
        assert response.status == 200
    assert proxy.connects == [f"provider.test:{server.port}"]


# The CA bundle ---------------------------------------------------------------------------------------


async def test_a_ca_bundle_verifies_a_provider_reached_directly(
    started: Any, pools: Callable[..., Pool], pki: Pki
) -> None:
    server = await tls_server(started, pki)
    pool = pools(ca_bundle=str(pki.ca_file))
    assert pool.ca_bundle == str(pki.ca_file)
    async with await pool.post(f"https://localhost:{server.port}/v1/chat/completions", b"{}") as response:
        assert await response.read() == b'{"echo": 2}'


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to hash a directory")
async def test_a_ca_bundle_can_be_a_hashed_directory(
    started: Any, pools: Callable[..., Pool], pki: Pki, tmp_path: Path
) -> None:
    folder = tmp_path / "cas"
    folder.mkdir()
    shutil.copy(pki.ca_file, folder / "test-ca.pem")
    subprocess.run(["openssl", "rehash", str(folder)], check=True, capture_output=True)
    server = await tls_server(started, pki)
    pool = pools(ca_bundle=str(folder))
    async with await pool.post(f"https://localhost:{server.port}/v1/chat/completions", b"{}") as response:
        assert response.status == 200


def test_a_ca_bundle_that_cannot_serve_is_refused_when_the_pool_is_made(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        Pool(ca_bundle=str(tmp_path / "missing.pem"))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"the CA bundle {garbage} holds no certificate"):
        Pool(ca_bundle=str(garbage))
    unhashed = tmp_path / "unhashed"
    unhashed.mkdir()
    shutil.copy(pki.ca_file, unhashed / "ca.pem")
    with pytest.raises(ValueError, match="openssl rehash"):
        Pool(ca_bundle=str(unhashed))
    with pytest.raises(ValueError, match="not both"):
        Pool(ca_bundle=str(pki.ca_file), ssl_context=ssl.create_default_context())
    assert Pool(ca_bundle="").ca_bundle is None  # an empty setting means the default store
