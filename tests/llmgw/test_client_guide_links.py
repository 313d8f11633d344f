"""The overview and the account page send whoever writes a client to the client guide, /docs/clients."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from apps.accounts.models import User

pytestmark = pytest.mark.django_db

GUIDE_LINK = re.compile(r"<p [^>]*data-client-guide>(.*?)</p>", re.DOTALL)


def guide_line(user: User, url: str) -> str:
    client = Client()
    client.force_login(user)
    response = client.get(url)
    assert response.status_code == 200
    found = GUIDE_LINK.findall(response.content.decode())
    assert len(found) == 1, found
    return str(found[0])


@pytest.mark.parametrize("url", ["/", "/account/"])
def test_the_page_links_the_client_guide_with_a_line_on_what_it_is(bob: User, url: str) -> None:
    line = guide_line(bob, url)
    assert '<a class="text-indigo-700 underline" href="/docs/clients">client guide</a>' in line
    assert "OpenAI and Anthropic SDKs" in line
    # The guide is there, for the same person.
    client = Client()
    client.force_login(bob)
    assert client.get("/docs/clients").status_code == 200
