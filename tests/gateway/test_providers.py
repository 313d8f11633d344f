"""External providers over the internet, through an organisation's proxy: the whole gateway, the
official OpenAI SDK in front of it, a local CONNECT proxy and a TLS provider with a private CA."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.gateway.harness import HELLO, Gateway, endpoint, gateway_fixture, openai, route
from tests.gateway.mock_engine import MockEngine
from tests.gateway.test_upstream_proxy import PROXY_VARIABLES, LocalProxy, Pki, make_pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest.fixture
async def provider(pki: Pki) -> AsyncIterator[MockEngine]:
    mock = await MockEngine().start(ssl_context=pki.server_context())
    yield mock
    await mock.stop()


@pytest.fixture
async def proxy() -> AsyncIterator[LocalProxy]:
    running = await LocalProxy().start()
    yield running
    await running.stop()


@pytest.fixture
async def proxied(
    provider: MockEngine, proxy: LocalProxy, pki: Pki, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Gateway]:
    """The gateway started in an environment whose proxy variables name the local proxy."""
    from django.conf import settings

    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    with_bundle = getattr(request, "param", True)
    monkeypatch.setattr(settings, "PROVIDER_CA_BUNDLE", str(pki.ca_file) if with_bundle else "")
    async for gateway in gateway_fixture(provider, monkeypatch):
        yield gateway


def external(provider: MockEngine) -> str:
    return f"https://provider.test:{provider.url.rsplit(':', 1)[1]}"


async def test_a_provider_is_reached_through_the_proxy_and_checked_against_the_ca_bundle(
    proxied: Gateway, provider: MockEngine, proxy: LocalProxy
) -> None:
    proxied.set_models(
        route(
            "m",
            [
                endpoint(
                    external(provider),
                    "external:m",
                    engine="external",
                    hardware="external",
                    node="",
                    secret="sk-provider",
                )
            ],
            external=True,
        )
    )
    completion = await proxied.openai().chat.completions.create(model="m", messages=HELLO)
    assert completion.choices[0].message.content == "Hello there"
    port = provider.url.rsplit(":", 1)[1]
    assert f"provider.test:{port}" in proxy.connects
    # The provider's key went to the provider inside the tunnel, never in the clear to the proxy.
    assert provider.seen[-1].headers["Authorization"] == "Bearer sk-provider"
    assert "Bearer sk-provider" not in proxy.seen("authorization")


@pytest.mark.parametrize("proxied", [False], indirect=True)
async def test_a_provider_whose_certificate_the_system_does_not_trust_is_a_502_saying_so(
    proxied: Gateway, provider: MockEngine
) -> None:
    proxied.set_models(
        route(
            "m",
            [endpoint(external(provider), "external:m", engine="external", hardware="external", node="")],
            external=True,
        )
    )
    with pytest.raises(openai.APIStatusError) as raised:
        await proxied.openai().chat.completions.create(model="m", messages=HELLO)
    assert raised.value.status_code == 502
    assert "certificate" in raised.value.message.lower()
    assert provider.seen == []


async def test_engines_on_the_nodes_are_never_sent_through_the_proxy(
    proxied: Gateway, engine_url: str, proxy: LocalProxy
) -> None:
    proxied.set_models(route("m", [endpoint(engine_url, "7")]))
    assert (await proxied.chat()).status == 200
    assert proxy.connections == 0


@pytest.fixture
async def engine_url() -> AsyncIterator[str]:
    """A replica's engine on loopback, as `llmgw up` runs one."""
    mock = await MockEngine().start()
    yield mock.url
    await mock.stop()
