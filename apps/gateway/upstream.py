"""The gateway's HTTP/1.1 client for engines and external providers: pooled keep-alive
connections on plain asyncio protocols, parsed by httptools (the parser uvicorn uses).

It does only what the gateway needs — POST a JSON body, read the answer whole or chunk by
chunk — and so spends a fraction of a general client's time on each request, which is the
time the gateway adds to every answer.

- One pool of idle connections per (scheme, host, port, proxy). A connection goes back to the
  pool only when its answer was read to the end and both sides keep it alive; one that was not
  read to the end is closed, which is how an engine learns that its caller went away.
- A pooled connection that the other side closed while it sat idle is noticed and dropped;
  one that closes after the request was written but before a byte of the answer came back
  is tried once more on a brand-new connection (the server dropped it idle at the same moment).
- A server that says how long it keeps an idle connection (`Keep-Alive: timeout=N`, which
  llama.cpp sends with N=5) is believed: its connection is not used again once it has been
  idle for N less a second, so the gateway does not race the server's close.
- `connect_timeout` bounds opening a connection (proxy, tunnel and TLS included);
  `read_timeout` bounds each wait for the next bytes of an answer, as a socket read timeout would.
- While more than HIGH_WATER bytes of an answer wait to be read, the socket is not read
  from, so a slow client holds back its engine instead of filling the gateway's memory.

Certificates
    Providers' certificates are verified against `Pool(ca_bundle=...)` when it is given — a PEM
    file, or a directory in OpenSSL's hashed form (`openssl rehash`), used *instead of* the
    system store — and otherwise against Python's default context, which honours
    `SSL_CERT_FILE` and `SSL_CERT_DIR`. A bundle that is missing or holds no certificate fails
    when the Pool is made, not at the first request an hour later.

Proxies
    A provider on the internet is often reachable only through an organisation's HTTP proxy.
    `Pool(proxies=...)` takes a `ProxyConfig`; without one the Pool reads the environment once,
    when it is made (`ProxyConfig.from_env()`), never per request: which proxy a URL goes
    through is decided when the URL is first seen and kept with it, so a request to an engine
    costs nothing more than it did without proxies. `ProxyConfig()` turns proxies off.

    - `https_proxy`/`HTTPS_PROXY` is used for https targets, `http_proxy`/`HTTP_PROXY` for http
      ones; the lower-case name wins when both are set, as with curl and urllib. `HTTP_PROXY`
      is ignored when `REQUEST_METHOD` is set (a CGI environment, where a client's `Proxy:`
      header would arrive as that variable), as urllib does. `ALL_PROXY` is not read: it often
      names a SOCKS proxy, which this client does not speak.
    - A proxy URL is `http://[user:password@]host[:port]` (the scheme may be left out; the port
      defaults to 80). User and password are percent-decoded and sent as
      `Proxy-Authorization: Basic ...`. `https://` proxies (TLS to the proxy itself) and SOCKS
      are refused with an error when the config is made.
    - https targets go through a tunnel: `CONNECT host:port` to the proxy, then TLS to the target
      inside it, verified against the target's own name. The target's name is resolved by the
      proxy, not here. A proxy's answer other than 2xx is a ConnectError naming the proxy and
      its status line (so a 407 says that credentials are missing or wrong).
    - http targets are asked through the proxy in absolute form (`POST http://host:port/path`);
      a 407 from the proxy is a ConnectError too.

    NO_PROXY (`no_proxy` wins over `NO_PROXY`) lists targets reached directly. It follows curl
    (7.86 and later) with one addition:

    - entries are separated by commas (spaces around them are ignored); matching ignores case
      and a trailing dot of the target's name;
    - `*` alone bypasses the proxy for every target;
    - a name matches itself and every name below it: `example.com`, `.example.com` and
      `*.example.com` all match `example.com` and `api.example.com`, not `notexample.com`;
    - an IP address matches that address, a CIDR range (`10.0.0.0/8`, `fd00::/8`) every
      address in it; IPv6 is written without brackets, or in brackets with a port. Names match
      only names and addresses only addresses: nothing is resolved to decide;
    - `host:port` (or `[v6]:port`) matches that host, or that name and the names below it, on
      that port only; entries that cannot be read as any of these match nothing;
    - the addition: loopback targets — `localhost`, names under `.localhost`, 127.0.0.0/8, ::1
      — are never proxied (as Go's net/http does; curl would send them to the proxy). A proxy
      cannot reach this machine's loopback, and an engine on it must never go through one.
      Engines on the nodes are usually on private addresses: list them (or their range) in
      NO_PROXY.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import ipaddress
import os
import re
import ssl
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import httptools

__all__ = [
    "ConnectError",
    "Disconnected",
    "Pool",
    "Proxy",
    "ProxyConfig",
    "ReadTimeout",
    "Response",
    "UpstreamError",
    "ssl_context_for",
]

HIGH_WATER = 1024 * 1024
LOW_WATER = 256 * 1024
PROXY_HEAD_LIMIT = 64 * 1024  # a proxy's answer to CONNECT longer than this is not an answer


# A connection the server keeps N s idle is not used after N - KEEP_ALIVE_MARGIN s idle.
KEEP_ALIVE_MARGIN = 1.0


def _keep_alive_timeout(value: str) -> float | None:
    """The `timeout=N` of a Keep-Alive header, in seconds; None when absent or not a number."""
    for part in value.split(","):
        name, _, number = part.strip().partition("=")
        if name.strip().lower() == "timeout":
            try:
                seconds = float(number.strip())
            except ValueError:
                return None
            return seconds if seconds == seconds and seconds >= 0 else None  # noqa: PLR0124 - NaN
    return None


class UpstreamError(Exception):
    """The upstream could not be asked, or its answer could not be read."""


class ConnectError(UpstreamError):
    """No connection could be opened (refused, unreachable, name unknown, proxy, TLS, timed out)."""


class Disconnected(UpstreamError):
    """The upstream closed the connection before its answer was complete."""


class ReadTimeout(UpstreamError):
    """The upstream sent nothing for longer than the read timeout."""


# Proxies -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Proxy:
    """One HTTP proxy. It is part of a pooled connection's key, so equal proxies share connections
    and a change of credentials does not reuse a tunnel opened with the old ones."""

    host: str
    port: int
    authorization: str | None = field(default=None, repr=False)  # the whole Proxy-Authorization value

    @classmethod
    def parse(cls, url: str) -> Proxy:
        """`http://[user:password@]host[:port]`, the scheme optional; ValueError for anything else,
        with the URL's password left out of the message."""
        raw = url.strip()
        if "://" not in raw:
            raw = "http://" + raw  # as curl reads `proxy.example:3128`
        parts = urlsplit(raw)
        shown = _without_password(raw)
        if parts.scheme == "https":
            raise ValueError(
                f"the proxy {shown} is an https:// proxy (TLS to the proxy), which is not supported: "
                "use its http:// address (https targets are still tunnelled with TLS end to end)"
            )
        if parts.scheme != "http":
            raise ValueError(f"the proxy {shown} is not an http:// proxy ({parts.scheme}:// is not supported)")
        if not parts.hostname:
            raise ValueError(f"the proxy URL {shown} names no host")
        try:
            port = parts.port or 80
        except ValueError:
            raise ValueError(f"the proxy URL {shown} has an invalid port") from None
        authorization = None
        if parts.username is not None:
            credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            authorization = "Basic " + base64.b64encode(credentials).decode("ascii")
        return cls(parts.hostname, port, authorization)

    @property
    def url(self) -> str:
        """How the proxy is named in errors and logs: never with its credentials."""
        name = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{name}:{self.port}"


def _without_password(url: str) -> str:
    return re.sub(r"(//[^/@:]*):[^/@]*@", r"\1:***@", url)


def _proxy(value: str | Proxy | None) -> Proxy | None:
    if isinstance(value, str):
        return Proxy.parse(value) if value.strip() else None
    return value


_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(host: str) -> _Address | None:
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # a scoped IPv6 address keeps its zone apart
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class ProxyConfig:
    """Which proxy, if any, each target goes through; see the module's docstring for the rules.

    Made once (from the environment or explicitly) and consulted once per URL a Pool sees."""

    __slots__ = ("_bypass_all", "_names", "_networks", "http", "https", "no_proxy", "proxy_loopback")

    def __init__(
        self,
        *,
        http: str | Proxy | None = None,
        https: str | Proxy | None = None,
        no_proxy: str = "",
        proxy_loopback: bool = False,
    ) -> None:
        """`http`/`https`: the proxy for http/https targets (a URL or a Proxy; None or "" for none).
        `no_proxy`: NO_PROXY's syntax. `proxy_loopback`: send loopback targets to the proxy too —
        only for a proxy that can reach this machine's loopback (tests do; deployments should not)."""
        self.http = _proxy(http)
        self.https = _proxy(https)
        self.no_proxy = no_proxy
        self.proxy_loopback = proxy_loopback
        self._bypass_all = False
        self._names: list[tuple[str, int | None]] = []
        self._networks: list[tuple[_Network, int | None]] = []
        for entry in no_proxy.replace(" ", ",").split(","):
            self._add_bypass(entry.strip().lower())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProxyConfig:
        """The proxies the standard environment variables name (os.environ unless given)."""
        env = os.environ if environ is None else environ

        def first(*names: str) -> str:
            for name in names:
                value = env.get(name, "").strip()
                if value:
                    return value
            return ""

        http_names = ("http_proxy",) if "REQUEST_METHOD" in env else ("http_proxy", "HTTP_PROXY")
        return cls(
            http=first(*http_names), https=first("https_proxy", "HTTPS_PROXY"), no_proxy=first("no_proxy", "NO_PROXY")
        )

    def __bool__(self) -> bool:
        return self.http is not None or self.https is not None

    def __repr__(self) -> str:
        http = self.http.url if self.http else None
        https = self.https.url if self.https else None
        return f"ProxyConfig(http={http!r}, https={https!r}, no_proxy={self.no_proxy!r})"

    def _add_bypass(self, entry: str) -> None:
        if not entry:
            return
        if entry == "*":
            self._bypass_all = True
            return
        port: int | None = None
        host = entry
        if entry.startswith("["):  # [v6] or [v6]:port
            close = entry.find("]")
            rest = entry[close + 1 :]
            if close < 0 or (rest and not (rest.startswith(":") and rest[1:].isascii() and rest[1:].isdigit())):
                return
            host, port = entry[1:close], int(rest[1:]) if rest else None
        elif entry.count(":") == 1:  # name:port or v4:port (an IPv6 address has more colons)
            name, _, digits = entry.partition(":")
            if not (digits.isascii() and digits.isdigit()):  # "²" passes isdigit() and fails int()
                return
            host, port = name, int(digits)
        try:
            self._networks.append((ipaddress.ip_network(host, strict=False), port))
            return
        except ValueError:
            pass
        name = host.removeprefix("*").removeprefix(".").rstrip(".")
        if name:
            self._names.append((name, port))

    def bypasses(self, host: str, port: int) -> bool:
        """Whether a target is reached directly rather than through a proxy."""
        if self._bypass_all:
            return True
        host = host.lower().rstrip(".")
        address = _ip(host)
        if address is not None:
            if address.is_loopback and not self.proxy_loopback:
                return True
            return any(address in network and (p is None or p == port) for network, p in self._networks)
        if not self.proxy_loopback and (host == "localhost" or host.endswith(".localhost")):
            return True
        return any((host == name or host.endswith("." + name)) and (p is None or p == port) for name, p in self._names)

    def select(self, tls: bool, host: str, port: int) -> Proxy | None:
        """The proxy for a target, or None to connect to it directly."""
        proxy = self.https if tls else self.http
        if proxy is None or self.bypasses(host, port):
            return None
        return proxy

    def for_url(self, url: str) -> Proxy | None:
        """The proxy for an http(s) URL, or None to connect directly."""
        target = _Target(url, self)
        return target.proxy


# CA bundles -----------------------------------------------------------------------------------------

_HASHED = re.compile(r"^[0-9a-f]{8}\.\d+$")  # a certificate under OpenSSL's name (a CRL's has an "r")


def ssl_context_for(ca_bundle: str) -> ssl.SSLContext:
    """A client context that trusts only the certificates of `ca_bundle` (a PEM file, or a directory
    in OpenSSL's hashed form). ValueError, saying what is wrong, for a path that cannot serve."""
    if os.path.isdir(ca_bundle):
        try:
            names = os.listdir(ca_bundle)
        except OSError as exc:
            raise ValueError(f"the CA bundle directory {ca_bundle} cannot be read: {exc}") from None
        if not any(_HASHED.match(name) for name in names):
            raise ValueError(
                f"the CA bundle directory {ca_bundle} holds no certificate under OpenSSL's hashed "
                "names (run `openssl rehash` on it, or give a PEM file)"
            )
        return ssl.create_default_context(capath=ca_bundle)
    if not os.path.exists(ca_bundle):
        raise ValueError(f"the CA bundle {ca_bundle} does not exist")
    try:
        return ssl.create_default_context(cafile=ca_bundle)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"the CA bundle {ca_bundle} holds no certificate that could be read: {exc}") from None


# Connections ---------------------------------------------------------------------------------------


_Key = tuple[str, str, int, Proxy | None]


class _Target:
    """A URL taken apart once: where to connect, through which proxy, and the start of its request."""

    __slots__ = ("authority", "connect", "head", "host", "host_header", "key", "path", "port", "proxy", "tls")

    def __init__(self, url: str, proxies: ProxyConfig | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        default = 443 if self.tls else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = name if self.port == default else f"{name}:{self.port}"
        self.authority = f"{name}:{self.port}"
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.proxy = proxies.select(self.tls, self.host, self.port) if proxies else None
        self.key: _Key = (parts.scheme, self.host, self.port, self.proxy)
        self.connect = b""
        if self.proxy is not None and not self.tls:  # the proxy is asked for the whole URL
            authorization = self.proxy.authorization
            extra = f"Proxy-Authorization: {authorization}\r\n" if authorization else ""
            self.head = f"POST http://{self.host_header}{self.path} HTTP/1.1\r\nHost: {self.host_header}\r\n{extra}"
        else:  # directly, or inside a tunnel: the target sees what it would see without a proxy
            self.head = f"POST {self.path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
            if self.proxy is not None:
                authorization = self.proxy.authorization
                extra = f"Proxy-Authorization: {authorization}\r\n" if authorization else ""
                self.connect = f"CONNECT {self.authority} HTTP/1.1\r\nHost: {self.authority}\r\n{extra}\r\n".encode(
                    "latin-1"
                )


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self, pool: Pool, key: _Key) -> None:
        self.pool = pool
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        # How long the server said it keeps this connection idle (Keep-Alive: timeout=N); None: not said.
        self.server_idle: float | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received_any = False
        self.error: BaseException | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("the upstream tried to upgrade the connection"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"the upstream's answer is not valid HTTP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.complete:
            return
        if self.headers_done and not self._framed():
            self.on_message_complete()  # an answer without length or chunks ends when the connection does
            return
        what = "while it was sent" if self.headers_done else "before answering"
        detail = f": {exc}" if exc else ""
        self._fail(Disconnected(f"the upstream closed the connection {what}{detail}"))

    # httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:  # whole: httptools joins split reads itself
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer: the real one follows
            self.headers = {}
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()  # only known while the parser is in this answer
        if self.keep_alive and "keep-alive" in self.headers:
            self.server_idle = _keep_alive_timeout(self.headers["keep-alive"])
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if not self.headers_done:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.headers_done:
            return
        self.complete = True
        self._wake()

    # ----------------------------------------------------------------------------------------

    def _framed(self) -> bool:
        return "content-length" in self.headers or "chunked" in self.headers.get("transfer-encoding", "").lower()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until something new arrives (headers, body, the end, an error); at most read_timeout."""
        self.waiter = self.loop.create_future()
        timer = self.loop.call_later(self.pool.read_timeout, self._timed_out, self.waiter)
        try:
            await self.waiter
        finally:
            timer.cancel()
            self.waiter = None

    def _timed_out(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            self._fail(ReadTimeout(f"the upstream sent nothing for {self.pool.read_timeout:g} s"))

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class _ProxiedConnection(_Connection):
    """A connection to an http target through a proxy. A 407 is the proxy's own refusal, not the
    target's answer, and is reported as such rather than handed to the client as the provider's."""

    def __init__(self, pool: Pool, key: _Key, proxy: Proxy) -> None:
        self.proxy = proxy
        self.reason = ""
        super().__init__(pool, key)

    def on_status(self, status: bytes) -> None:
        self.reason = status.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.parser.get_status_code() == 407:
            self._fail(ConnectError(f"the proxy {self.proxy.url} refused the request: 407 {self.reason}".rstrip()))
            return
        super().on_headers_complete()


class _Tunnel(asyncio.Protocol):
    """A connection to a proxy until it answers CONNECT; TLS to the target then takes it over."""

    def __init__(self, loop: asyncio.AbstractEventLoop, proxy: Proxy, target: _Target) -> None:
        self.proxy = proxy
        self.target = target
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future[bytes] = loop.create_future()
        self.buffer = bytearray()
        self.more = False  # bytes came after the answer's head, which a tunnel's target would have sent

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.answer.done():
            self.more = True
            return
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end >= 0:
            self.more = end + 4 < len(self.buffer)
            self.answer.set_result(bytes(self.buffer[:end]))
        elif len(self.buffer) > PROXY_HEAD_LIMIT:
            self.answer.set_exception(
                ConnectError(
                    f"the proxy {self.proxy.url} answered CONNECT {self.target.authority} with more than "
                    f"{PROXY_HEAD_LIMIT} bytes of head"
                )
            )

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.answer.done():
            detail = f": {exc}" if exc else ""
            self.answer.set_exception(
                ConnectError(
                    f"the proxy {self.proxy.url} closed the connection before answering CONNECT "
                    f"{self.target.authority}{detail}"
                )
            )

    async def established(self) -> None:
        """Until the proxy has answered; ConnectError, with its status line, unless that was a 2xx."""
        head = await self.answer
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        version, _, rest = line.partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise ConnectError(f"the proxy {self.proxy.url} did not answer CONNECT in HTTP: {line[:100]!r}")
        if rest[0] != "2":
            raise ConnectError(f"the proxy {self.proxy.url} refused the tunnel to {self.target.authority}: {line}")
        if self.more:
            raise ConnectError(
                f"the proxy {self.proxy.url} sent more than its answer to CONNECT {self.target.authority}"
            )


class Response:
    """One answer. Use as an async context manager: leaving it before the answer was read to the
    end closes the connection (the upstream stops its work); otherwise the connection is reused."""

    __slots__ = ("_conn", "_done", "headers", "status")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._done = False

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    async def read(self) -> bytes:
        conn = self._conn
        parts: list[bytes] = []
        while True:
            if conn.chunks:
                parts.append(conn.take())
            if conn.complete:
                return b"".join(parts)
            if conn.error is not None:
                raise conn.error
            await conn.wait()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: whatever bytes came since the last chunk, never empty."""
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait()

    def release(self) -> None:
        if self._done:
            return
        self._done = True
        conn = self._conn
        if conn.reusable() and not conn.chunks:
            conn.pool._put(conn)
        else:
            conn.close()


class Pool:
    """Keep-alive connections to engines and providers, and the one way the gateway asks them."""

    def __init__(
        self,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 600.0,
        idle_timeout: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
        ca_bundle: str | None = None,
        proxies: ProxyConfig | None = None,
    ) -> None:
        """`ca_bundle`: a PEM file or hashed directory whose certificates alone verify https targets
        (None or "": the default context, with SSL_CERT_FILE/SSL_CERT_DIR); `ssl_context`: a whole
        context instead, not with `ca_bundle`. `proxies`: None reads the environment now, once;
        `ProxyConfig()` uses no proxy. ValueError for a bundle or proxy that cannot serve."""
        if ssl_context is not None and ca_bundle:
            raise ValueError("give the Pool an ssl_context or a ca_bundle, not both")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle_timeout = idle_timeout
        self.ca_bundle = ca_bundle or None
        self._ssl = ssl_context_for(ca_bundle) if ca_bundle else ssl_context
        self.proxies = ProxyConfig.from_env() if proxies is None else proxies
        self._idle: dict[_Key, list[_Connection]] = {}
        self._targets: dict[str, _Target] = {}
        self._open: set[_Connection] = set()

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            target = _Target(url, self.proxies)
            if len(self._targets) > 4096:
                self._targets.clear()
            self._targets[url] = target
        return target

    async def post(self, url: str, body: bytes, headers: Sequence[tuple[str, str]] = ()) -> Response:
        """Send the request and wait for the answer's status and headers."""
        target = self.target(url)
        lines = [f"{target.head}Content-Length: {len(body)}\r\nAccept-Encoding: identity\r\n"]
        for name, value in headers:
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise UpstreamError(f"the header {name!r} holds a line break")
            lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        request = "".join(lines).encode("latin-1") + body
        for attempt in (0, 1):
            conn = await self._connection(target, pooled=attempt == 0)
            conn.transport.write(request)  # type: ignore[union-attr]
            try:
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait()
            except Disconnected:
                if conn.reused and not conn.received_any and attempt == 0:
                    continue  # closed idle by the server as we sent: once more, on a new connection
                raise
            except BaseException:
                conn.close()
                raise
            return Response(conn)
        raise AssertionError("unreachable")

    async def _connection(self, target: _Target, *, pooled: bool = True) -> _Connection:
        """An idle connection to the target that is still worth using, or a new one (always a new
        one when not `pooled`)."""
        idle = self._idle.get(target.key) if pooled else None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            limit = self.idle_timeout
            if conn.server_idle is not None:
                limit = min(limit, conn.server_idle - KEEP_ALIVE_MARGIN)
            if conn.closed or now - conn.idle_since > limit:
                conn.close()
                continue
            conn.reused = True
            conn._reset()
            return conn
        loop = asyncio.get_running_loop()
        proxy = target.proxy
        if proxy is None or target.tls:
            conn = _Connection(self, target.key)
        else:
            conn = _ProxiedConnection(self, target.key, proxy)
        try:
            async with asyncio.timeout(self.connect_timeout):
                if proxy is not None:
                    await self._open_through(proxy, conn, target)
                elif target.tls:
                    await loop.create_connection(
                        lambda: conn, target.host, target.port, ssl=self._ssl_context(), server_hostname=target.host
                    )
                else:
                    await loop.create_connection(lambda: conn, target.host, target.port)
        except TimeoutError:
            conn.close()
            via = f" through the proxy {proxy.url}" if proxy is not None else ""
            raise ConnectError(
                f"could not connect to {target.host_header}{via} within {self.connect_timeout:g} s"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            conn.close()
            raise ConnectError(f"could not connect to {target.host_header}: {exc}") from None
        except BaseException:
            conn.close()
            raise
        self._open.add(conn)
        return conn

    async def _open_through(self, proxy: Proxy, conn: _Connection, target: _Target) -> None:
        """Connect `conn` to the target through the proxy: for http the proxy is its peer; for https
        a CONNECT tunnel is opened and TLS to the target started inside it (the target's name for
        SNI and verification, the tunnel's bytes seen by the proxy only as ciphertext)."""
        loop = conn.loop
        if not target.tls:
            try:
                await loop.create_connection(lambda: conn, proxy.host, proxy.port)
            except OSError as exc:
                raise ConnectError(
                    f"could not connect to the proxy {proxy.url} for {target.host_header}: {exc}"
                ) from None
            return
        tunnel = _Tunnel(loop, proxy, target)
        try:
            await loop.create_connection(lambda: tunnel, proxy.host, proxy.port)
        except OSError as exc:
            raise ConnectError(f"could not connect to the proxy {proxy.url} for {target.host_header}: {exc}") from None
        raw = tunnel.transport
        assert raw is not None  # connection_made has run once create_connection returned
        try:
            raw.write(target.connect)
            await tunnel.established()
            try:
                transport = await loop.start_tls(raw, conn, self._ssl_context(), server_hostname=target.host)
            except (OSError, ssl.SSLError) as exc:
                raise ConnectError(
                    f"could not connect to {target.host_header} through the proxy {proxy.url}: {exc}"
                ) from None
            if transport is None:
                raise ConnectError(f"TLS to {target.host_header} could not start through the proxy {proxy.url}")
        except BaseException:
            raw.abort()
            raise
        conn.connection_made(transport)  # start_tls gives the protocol its transport without calling it

    def _put(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        conn.waiter = None
        self._idle.setdefault(conn.key, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def abort(self, reason: str) -> int:
        """End every answer still being read with Disconnected(reason): this process is stopping and
        the grace for its requests in flight is over. Returns how many there were."""
        idle = {conn for conns in self._idle.values() for conn in conns}
        busy = [conn for conn in self._open if conn not in idle and not conn.complete]
        for conn in busy:
            conn._fail(Disconnected(reason))
        return len(busy)

    async def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        self._open.clear()
        await asyncio.sleep(0)  # let the transports finish closing
