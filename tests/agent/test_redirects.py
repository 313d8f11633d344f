"""Where a download may be redirected (agent/install/redirects.py), against real local servers: the
host the operator configured, yes; this machine's loopback services under another name, the
control plane itself, link-local addresses and endless chains, no; and a name that resolves to a
public address when the redirect is read but to loopback when connecting gains nothing."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from agent.install import redirects
from agent.install.fetch import opener
from agent.install.redirects import Destinations
from tests.localhttp import LocalHTTP


class Site:
    """A server whose paths redirect where `moves` says; other paths answer 200 'ok'."""

    def __init__(self) -> None:
        self.moves: dict[str, str] = {}
        self.asked: list[tuple[str, str | None]] = []
        self.http = LocalHTTP(self._answer)

    def _answer(self, handler: Any, head: bool) -> None:
        self.asked.append((handler.path, handler.headers.get("Authorization")))
        target = self.moves.get(handler.path)
        handler.send_response(302 if target else 200)
        if target:
            handler.send_header("Location", target.replace("{self}", self.base))
        handler.send_header("Content-Length", "0" if target else "2")
        handler.end_headers()
        if not target and not head:
            handler.wfile.write(b"ok")

    @property
    def base(self) -> str:
        return self.http.base

    @property
    def port(self) -> int:
        return int(self.http.httpd.server_address[1])


@pytest.fixture
def sites() -> Iterator[tuple[Site, Site]]:
    pair = (Site(), Site())
    for site in pair:
        site.http.start()
    yield pair
    for site in pair:
        site.http.stop()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def fetch(url: str, destinations: Destinations | None = None, **headers: str) -> bytes:
    with opener(None, destinations).open(urllib.request.Request(url, headers=headers), timeout=10) as answer:
        return bytes(answer.read())


def refusal(url: str, destinations: Destinations | None = None) -> str:
    with pytest.raises(OSError) as caught:  # RedirectRefused, or urllib's URLError carrying it
        fetch(url, destinations)
    reason = getattr(caught.value, "reason", caught.value)
    assert isinstance(reason, redirects.RedirectRefused), repr(caught.value)
    return str(reason)


def test_the_configured_host_on_another_port_is_followed_and_the_token_stays_behind(sites: tuple[Site, Site]) -> None:
    hub, storage = sites
    hub.moves["/file"] = f"{storage.base}/blob"
    assert fetch(f"{hub.base}/file", Authorization="Bearer hub-token") == b"ok"
    assert hub.asked == [("/file", "Bearer hub-token")]
    assert storage.asked == [("/blob", None)]


def test_loopback_under_another_name_is_refused(sites: tuple[Site, Site]) -> None:
    hub, local = sites
    hub.moves["/file"] = f"http://localhost:{local.port}/metrics"
    why = refusal(f"{hub.base}/file")
    assert why == f"a redirect to localhost:{local.port} is refused: localhost is a loopback address (127.0.0.1)"
    assert local.asked == []


def test_the_control_plane_itself_is_refused_even_on_the_configured_host(sites: tuple[Site, Site]) -> None:
    hub, plane = sites
    hub.moves["/file"] = f"{plane.base}/metrics"
    why = refusal(f"{hub.base}/file", Destinations(forbidden=(("127.0.0.1", plane.port),)))
    assert why == f"a redirect to 127.0.0.1:{plane.port} is refused: 127.0.0.1:{plane.port} is the control plane itself"
    # listening on every address counts too
    why = refusal(f"{hub.base}/file", Destinations(forbidden=(("0.0.0.0", plane.port),)))
    assert why.endswith("is the control plane itself")
    assert plane.asked == []


@pytest.mark.parametrize(
    ("where", "kind"),
    [
        ("http://169.254.169.254/latest/meta-data/", "a link-local address (169.254.169.254)"),
        ("http://[fe80::1]/x", "a link-local address (fe80::1)"),
        ("http://0.0.0.0:9/x", "an unspecified address (0.0.0.0)"),
        ("http://224.0.0.1/x", "a multicast address (224.0.0.1)"),
    ],
)
def test_addresses_only_this_machine_reaches_are_refused(sites: tuple[Site, Site], where: str, kind: str) -> None:
    hub, _ = sites
    hub.moves["/file"] = where
    assert refusal(f"{hub.base}/file").endswith(f"is {kind}")


def test_other_schemes_and_endless_chains_are_refused(sites: tuple[Site, Site]) -> None:
    hub, _ = sites
    hub.moves["/file"] = "file:///etc/passwd"
    with pytest.raises(urllib.error.HTTPError, match="Redirection to url 'file:///etc/passwd' is not allowed"):
        fetch(f"{hub.base}/file")
    for index in range(10):
        hub.moves[f"/hop{index}"] = f"{{self}}/hop{index + 1}"
    with pytest.raises(urllib.error.HTTPError, match=f"more than {redirects.MAX_REDIRECTS} redirects"):
        fetch(f"{hub.base}/hop0")
    assert len(hub.asked) == 1 + redirects.MAX_REDIRECTS + 1  # the file, then the chain up to the limit


def test_a_name_that_resolves_elsewhere_when_connecting_is_refused_on_the_connection(
    sites: tuple[Site, Site], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DNS rebinding: `rebind.test` resolves to a public address when the redirect is read and to
    127.0.0.1 when the connection is made. The address really reached is checked, so the request
    is never sent. (A resolver of our own is the one fault here that cannot be caused for real.)"""
    hub, local = sites
    hub.moves["/file"] = f"http://rebind.test:{local.port}/metrics"
    real = socket.getaddrinfo
    answers = iter(["93.184.216.34"])

    def resolver(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "rebind.test":
            address = next(answers, "127.0.0.1")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    why = refusal(f"{hub.base}/file")
    assert why == f"a redirect to rebind.test:{local.port} is refused: rebind.test is a loopback address (127.0.0.1)"
    assert local.asked == []
