"""The mirror's tests: a Hub of ours holding repositories the tests make, and Celery's eager mode."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mirror.ggufbytes import header
from tests.mirror.hubserver import HubServer, Repo
from tests.mirror.test_safetensors import shard


def gguf(arch: str = "llama", pad: int = 300_000, **extra: Any) -> bytes:
    meta = {
        "general.architecture": arch,
        f"{arch}.block_count": 2,
        f"{arch}.embedding_length": 64,
        f"{arch}.attention.head_count": 4,
        **extra,
    }
    return header(meta) + os.urandom(pad)


def safetensors_files(tmp: Path) -> dict[str, bytes]:
    shard(tmp / "a.safetensors", {"a.weight": 4096, "b.weight": 1024})
    shard(tmp / "b.safetensors", {"c.weight": 8192})
    index = {
        "metadata": {"total_size": 4096 + 1024 + 8192},
        "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors",
            "b.weight": "model-00001-of-00002.safetensors",
            "c.weight": "model-00002-of-00002.safetensors",
        },
    }
    return {
        "model-00001-of-00002.safetensors": (tmp / "a.safetensors").read_bytes(),
        "model-00002-of-00002.safetensors": (tmp / "b.safetensors").read_bytes(),
        "model.safetensors.index.json": json.dumps(index).encode(),
        "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
        "tokenizer.json": b'{"version": "1.0"}',
        "README.md": b"# a model\n",
    }


@pytest.fixture
def hub(settings: Any, tmp_path: Path) -> Iterator[HubServer]:
    repos = [
        Repo(
            "acme/tiny-GGUF",
            {
                "tiny-Q4_K_M.gguf": gguf(),
                "tiny-Q8_0.gguf": gguf(pad=500_000),
                "big-00001-of-00002.gguf": gguf(split=1),
                "big-00002-of-00002.gguf": os.urandom(200_000),
                "mmproj-tiny-f16.gguf": gguf("clip"),
                "README.md": b"# tiny\n",
            },
            downloads=50,
        ),
        Repo("acme/tiny", safetensors_files(tmp_path), downloads=40),
        Repo("acme/other", {"x.gguf": gguf()}, downloads=10),
    ]
    with HubServer(repos) as server:
        settings.HF_ENDPOINT = server.url
        settings.MIRROR_DIR = str(tmp_path / "mirror")
        settings.MIRROR_CONCURRENT_FETCHES = 2
        settings.MIRROR_RESERVE_GB = 0
        yield server


@pytest.fixture
def eager(django_capture_on_commit_callbacks: Any) -> Iterator[Any]:
    """Celery runs the fetch tasks where they are sent (its own eager mode), after the commit."""
    from llmgw.celery import app

    app.conf.task_always_eager = True
    try:
        yield django_capture_on_commit_callbacks
    finally:
        app.conf.task_always_eager = False
