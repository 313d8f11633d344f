"""Where a download may be redirected to.

A Hub, a release server or the control plane may answer a request with a redirect; a hostile
one would point it at what only the fetching machine can reach: its own loopback services (the
control plane's `/metrics`, a local Redis), a cloud's link-local metadata address, or the control
plane itself. :class:`GuardedRedirects`, the redirect handler of every opener that fetches
(:func:`agent.install.fetch.opener`), follows a redirect only when all of these hold:

- the new URL is http or https;
- fewer than :data:`MAX_REDIRECTS` redirects were followed for the request;
- the new address is not loopback, link-local, unspecified, multicast or reserved, and not one of
  the control plane's own endpoints given as `forbidden` — unless it is the host the first
  request went to, which the operator configured (a Hub on 127.0.0.1 may send its files from
  another port of 127.0.0.1), or exactly the first request's endpoint.

The address is checked twice: when the redirect is read (the host's name resolved, for a clear
refusal before anything is sent), and on the connection itself once it is made (the peer's
address), so a name that resolves to something else the second time gains nothing. Credential
headers are never carried to another host (scheme, name or port).
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["MAX_REDIRECTS", "Destinations", "GuardedRedirects", "RedirectRefused", "endpoint", "handlers"]

#: The most redirects followed for one request (the Hub's resolve URL redirects once, to storage).
MAX_REDIRECTS = 5

#: Headers that carry credentials: never sent on to another host after a redirect (GitHub's
#: asset URLs redirect to a storage host that refuses requests with an Authorization header).
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})


class RedirectRefused(OSError):
    """A redirect that is not followed; str() says where it led and why."""


def endpoint(url: str) -> tuple[str, int]:
    """(host, port) a URL names, the host in lower case; port 0 when it is not a number."""
    split = urllib.parse.urlsplit(url)
    try:
        port = split.port or (443 if split.scheme == "https" else 80)
    except ValueError:
        port = 0
    return (split.hostname or "").lower(), port


def _addresses(host: str, port: int) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return set()


def _local_addresses() -> set[str]:
    names = {"localhost", socket.gethostname()}
    found = {"127.0.0.1", "::1"}
    for name in names:
        found |= _addresses(name, 0)
    return found


@dataclass(frozen=True)
class Destinations:
    """The control plane's own endpoints, (host, port), that no redirect may lead to; a host of
    ``0.0.0.0`` or ``::`` (listening everywhere) stands for every address of this machine."""

    forbidden: tuple[tuple[str, int], ...] = ()

    def _forbidden_addresses(self) -> set[tuple[str, int]]:
        found: set[tuple[str, int]] = set()
        for host, port in self.forbidden:
            wildcard = host in ("", "0.0.0.0", "::", "[::]")
            for address in _local_addresses() if wildcard else _addresses(host.strip("[]"), port) | {host}:
                found.add((_normal(address), port))
        return found

    def refusal(self, address: str, port: int, *, origin: tuple[str, int], host: str) -> str | None:
        """Why a redirect to `host` (connected, or resolved, at `address`:`port`) is refused, with
        the first request's endpoint `origin`; None when it may be followed."""
        if (host, port) == origin:
            return None
        if (_normal(address), port) in self._forbidden_addresses():
            return f"{host}:{port} is the control plane itself"
        if host == origin[0]:
            return None
        try:
            ip = ipaddress.ip_address(_normal(address))
        except ValueError:
            return f"{address} is not an address"
        for kind, test in _KINDS:
            if test(ip):
                return f"{host} is {kind} ({ip})"
        return None

    def url_refusal(self, url: str, *, origin: tuple[str, int], address: str | None = None) -> str | None:
        """Why a redirect to `url` is refused (its host resolved, or connected at `address`), after
        a first request to `origin`; None when it may be followed."""
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            return f"a redirect to {url[:200]} is refused: not http or https"
        host, port = endpoint(url)
        candidates = {address} if address is not None else _addresses(host, port)
        if not candidates:
            return f"a redirect leads to {host}, whose address cannot be found"
        for candidate in sorted(candidates):
            why = self.refusal(candidate, port, origin=origin, host=host)
            if why is not None:
                return f"a redirect to {host}:{port} is refused: {why}"
        return None


def _normal(address: str) -> str:
    text = address.split("%", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return text.lower()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


_KINDS: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("a loopback address", lambda ip: ip.is_loopback),
    ("a link-local address", lambda ip: ip.is_link_local),
    ("an unspecified address", lambda ip: ip.is_unspecified),
    ("a multicast address", lambda ip: ip.is_multicast),
    ("a reserved address", lambda ip: ip.is_reserved),
)


@dataclass(frozen=True)
class _Hop:
    """What a redirected request carries: where the first request went and the rules."""

    origin: tuple[str, int]
    destinations: Destinations
    count: int

    def check(self, url: str, address: str | None = None) -> None:
        why = self.destinations.url_refusal(url, origin=self.origin, address=address)
        if why is not None:
            raise RedirectRefused(why)


class GuardedRedirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirect handling with the rules above."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, destinations: Destinations | None = None) -> None:
        super().__init__()
        self.destinations = destinations or Destinations()

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: http.client.HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, f"{msg}, redirecting to a non-HTTP URL", headers, fp)
        previous: _Hop | None = getattr(req, "llmgw_hop", None)
        hop = _Hop(
            origin=previous.origin if previous else endpoint(req.full_url),
            destinations=self.destinations,
            count=(previous.count if previous else 0) + 1,
        )
        if hop.count > MAX_REDIRECTS:
            raise urllib.error.HTTPError(newurl, code, f"more than {MAX_REDIRECTS} redirects", headers, fp)
        hop.check(newurl)
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is None:
            return None
        new.llmgw_hop = hop  # type: ignore[attr-defined]
        if endpoint(newurl) != endpoint(req.full_url) or _scheme(newurl) != _scheme(req.full_url):
            for key in [key for key in new.headers if key.lower() in CREDENTIAL_HEADERS]:
                del new.headers[key]
        return new


def _scheme(url: str) -> str:
    return urllib.parse.urlsplit(url).scheme


class _Checked:
    """A connection that, for a redirected request, checks the address it really reached."""

    llmgw_hop: _Hop | None = None
    llmgw_url: str = ""

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        hop = self.llmgw_hop
        if hop is None:
            return
        sock: socket.socket = self.sock  # type: ignore[attr-defined]
        try:
            hop.check(self.llmgw_url, str(sock.getpeername()[0]))
        except RedirectRefused:
            sock.close()
            raise


class _CheckedHTTP(_Checked, http.client.HTTPConnection):
    pass


class _CheckedHTTPS(_Checked, http.client.HTTPSConnection):
    pass


def _factory(kind: type[_Checked], req: urllib.request.Request) -> Callable[..., Any]:
    def make(host: str, **kwargs: Any) -> Any:
        connection = kind(host, **kwargs)  # type: ignore[call-arg]
        # Through a proxy the peer is the proxy: the name was checked when the redirect was read.
        proxied = req.has_proxy() or getattr(req, "_tunnel_host", None)
        connection.llmgw_hop = None if proxied else getattr(req, "llmgw_hop", None)
        connection.llmgw_url = req.full_url
        return connection

    return make


class _HTTP(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_factory(_CheckedHTTP, req), req)


class _HTTPS(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(
            _factory(_CheckedHTTPS, req),
            req,
            context=self._context,  # type: ignore[attr-defined]
        )


def handlers(context: Any, destinations: Destinations | None = None) -> Iterable[urllib.request.BaseHandler]:
    """The handlers of an opener that follows redirects by these rules (`context`: the TLS one)."""
    return (GuardedRedirects(destinations), _HTTP(), _HTTPS(context=context))
