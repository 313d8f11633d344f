"""LoRA adapters from the mirror on a model's card: attached to its llama.cpp profiles (--lora,
--lora-scaled), refused for a model, a projector or another architecture with the reason, and
fetched by the nodes with the model's own source."""

from __future__ import annotations

import re
from typing import Any

import pytest

from apps.accounts.models import AuditEvent
from apps.catalog.models import Model
from apps.mirror import lora, services
from apps.mirror.hub import MirrorError
from tests.mirror.ggufbytes import header

pytestmark = pytest.mark.django_db


def model_header(arch: str) -> bytes:
    return header(
        {
            "general.architecture": arch,
            f"{arch}.block_count": 2,
            f"{arch}.embedding_length": 64,
            f"{arch}.attention.head_count": 4,
        }
    ) + bytes(512)


def adapter_header(arch: str, kind: str = "lora") -> bytes:
    return header({"general.architecture": arch, "general.type": "adapter", "adapter.type": kind}) + bytes(64)


@pytest.fixture
def held(hub: Any, eager: Any) -> dict[str, Any]:
    from tests.mirror.hubserver import Repo

    hub.add(Repo("acme/base-GGUF", {"base-F16.gguf": model_header("llama")}))
    hub.add(
        Repo(
            "acme/adapters",
            {
                "style-lora.gguf": adapter_header("llama"),
                "gemma-lora.gguf": adapter_header("gemma3"),
                "mmproj-x.gguf": header({"general.architecture": "clip", "general.type": "mmproj"}),
            },
        )
    )
    with eager(execute=True):
        base, style, gemma, projector = services.add_sources(
            [
                "hf://acme/base-GGUF/base-F16.gguf",
                "hf://acme/adapters/style-lora.gguf",
                "hf://acme/adapters/gemma-lora.gguf",
                "hf://acme/adapters/mmproj-x.gguf",
            ]
        )
    from apps.catalog.services import apply_models

    profile = {"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "1GB", "cpu_cores": 1}
    apply_models(
        [{"name": "base", "source": services.node_path(base, "base-F16.gguf"), "profiles": [profile]}], actor=None
    )
    return {"base": base, "style": style, "gemma": gemma, "projector": projector, "model": Model.objects.get()}


def test_an_adapter_of_the_models_architecture_is_attached_scaled_and_detached(held: dict[str, Any]) -> None:
    model, style = held["model"], held["style"]
    assert {h["version"] for h in lora.held_adapters()} == {style, held["gemma"]}
    path = lora.attach(model, style)
    assert model.profiles.get().extra_args == ["--lora", path]
    assert path == services.node_path(style, "style-lora.gguf")
    assert AuditEvent.objects.filter(action="profile.update").count() == 1  # audited; the replicas roll
    # The nodes fetch the adapter with the model's source.
    assert {item["version"] for item in services.node_fetches()} == {held["base"].pk, style.pk}
    lora.attach(model, style, 0.5)
    assert model.profiles.get().extra_args == ["--lora-scaled", f"{path}:0.5"]
    assert [(a.path, a.scale, a.version) for a in lora.attached(model)] == [(path, 0.5, style)]
    assert lora.detach(model, path) == 1
    assert model.profiles.get().extra_args == []
    with pytest.raises(MirrorError, match="does not load"):
        lora.detach(model, path)


@pytest.mark.parametrize(
    ("which", "reason"),
    [
        ("gemma", "is a LoRA for gemma3; base is llama"),
        ("base", "is a model, not an adapter"),
        ("projector", "is a projector, not an adapter"),
    ],
)
def test_what_cannot_be_attached_is_refused_with_the_reason(held: dict[str, Any], which: str, reason: str) -> None:
    with pytest.raises(MirrorError, match=reason):
        lora.attach(held["model"], held[which])
    assert held["model"].profiles.get().extra_args == []


def test_the_model_card_attaches_and_detaches(held: dict[str, Any], client: Any) -> None:
    from apps.accounts.choices import StaffRole
    from tests.conftest import make_user

    client.force_login(make_user("ops@example.com", role=StaffRole.OPERATOR))
    page = client.get("/models/base/").content.decode()
    assert 'data-section="adapters"' in page and "acme/adapters style-lora.gguf (llama)" in page
    answer = client.post("/mirror/adapters/base/attach", {"version": held["gemma"].pk, "scale": "1"})
    assert answer.status_code == 302
    page = client.get("/models/base/").content.decode()
    assert "is a LoRA for gemma3; base is llama" in page, re.findall(r'<li class="rounded-md[^>]*>([^<]*)</li>', page)
    client.post("/mirror/adapters/base/attach", {"version": held["style"].pk, "scale": "0.8"})
    path = services.node_path(held["style"], "style-lora.gguf")
    assert f'data-adapter="{path}"' in client.get("/models/base/").content.decode()
    client.post("/mirror/adapters/base/detach", {"path": path})
    assert held["model"].profiles.get().extra_args == []
