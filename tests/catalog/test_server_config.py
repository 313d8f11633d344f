from __future__ import annotations

from pathlib import Path

import pytest

from apps.catalog.models import Model
from apps.catalog.services import SpecError, apply_server_config

pytestmark = pytest.mark.django_db


def test_models_in_server_yaml_are_applied_once(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text(
        "models:\n  - name: from-file\n    replicas: 0\n    source: /m.gguf\n"
        "    profiles: [{name: cpu, accelerator: cpu, memory: 1GB}]\n"
    )
    assert [r.outcome for r in apply_server_config(str(path))] == ["created"]
    assert [r.outcome for r in apply_server_config(str(path))] == ["unchanged"]
    assert Model.objects.get(name="from-file").min_replicas == 0


def test_a_bad_server_yaml_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("models:\n  - name: bad\n    profiles: [{name: cpu, accelerator: cpu}]\n")
    with pytest.raises(SpecError) as error:
        apply_server_config(str(path))
    assert "models[0].profiles[0].memory" in error.value.errors


def test_the_shipped_server_example_loads(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "server.example.yaml"
    results = apply_server_config(str(example))
    assert results and all(r.outcome == "created" for r in results)
