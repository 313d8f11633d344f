"""A GGUF model's shape from its header, and the memory llama.cpp allocates to serve it.

`shape_of(header)` reads what the estimate needs: the architecture, layers, embedding, head counts
(a scalar or one per layer, 0 for a layer without attention), key and value lengths (their SWA
forms), the sliding window and which layers use it (a period, as Gemma 3's 6, or a per-layer
list), layers that share another's cache, experts, the vocabulary's size and split info.

`estimate(shape, weights, ctx_size=..., parallel=...)` is what llama-server allocates, part by part,
as llmgw starts it (`--ctx-size` the total the `--parallel` slots share, no unified cache):

- weights: the GGUF file(s) (the tokenizer's bytes are in the file but not in a buffer: a small
  overestimate, 2.6 % for Gemma 3 270M and less for anything larger);
- KV cache (`src/llama-kv-cache.cpp`): per layer `n_head_kv · (k · bytes_k + v · bytes_v) · cells`,
  times the streams (one per slot); full-attention layers hold `pad(ctx/slots, 256)` cells, SWA
  layers `pad(min(ctx/slots, window + ubatch), 256)` (`src/llama-kv-cache-iswa.cpp`);
- output: the logits buffer, one vocabulary-sized f32 row per slot;
- compute: the graph's scratch for one ubatch (the feed-forward's activations and the attention
  masks), an approximation of what the engine reserves;
- a fixed overhead: the process itself, beyond llama.cpp's buffers.

Without the fixed overhead, the estimate is within 5 % of the buffers llama-server reports for the
models the tests run it on (tests/mirror/test_estimate.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from apps.mirror.gguf import GGUFError, Header

__all__ = ["CACHE_TYPES", "Estimate", "Shape", "estimate", "shape_of"]

MiB = 2**20
#: Bytes per element of the KV cache, by `--cache-type-k/-v` (ggml block sizes: 32 elements).
CACHE_TYPES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}
#: Architectures whose GGUF gives a sliding window but not its pattern: llama.cpp's own period
#: (every Nth layer is full attention).
SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "cohere2": 4}
KV_PAD = 256
UBATCH = 512
#: Buffers no formula here covers (the backend's own, the sampler's, the server's slots).
FIXED_OVERHEAD = 8 * MiB


@dataclass(frozen=True)
class Shape:
    architecture: str
    kind: str  # "model", "adapter", "mmproj"
    block_count: int
    embedding_length: int
    context_length: int | None
    feed_forward_length: int | None
    head_count: tuple[int, ...]
    head_count_kv: tuple[int, ...]
    key_length: tuple[int, ...]
    value_length: tuple[int, ...]
    swa_layers: tuple[bool, ...]
    sliding_window: int | None
    kv_layers: tuple[bool, ...]  # layers that keep a cache of their own
    expert_count: int | None = None
    expert_used_count: int | None = None
    vocab_size: int | None = None
    split_count: int | None = None
    adapter_type: str | None = None

    @property
    def kv_layer_count(self) -> int:
        return sum(1 for i, has in enumerate(self.kv_layers) if has and self.head_count_kv[i] > 0)


@dataclass(frozen=True)
class Estimate:
    weights: int
    kv: int
    kv_full: int
    kv_swa: int
    cells: int  # per stream, full-attention layers
    swa_cells: int | None  # per stream, SWA layers
    streams: int
    output: int
    compute: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.output + self.compute + self.overhead

    def parts(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "kv_cache": self.kv,
            "output": self.output,
            "compute": self.compute,
            "overhead": self.overhead,
        }


def _int(meta: Mapping[str, Any], key: str, *, required: bool = False) -> int | None:
    value = meta.get(key)
    if value is None:
        if required:
            raise GGUFError(f"the header has no {key}")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"{key} is {type(value).__name__} {value!r}, not an integer")
    if value < 0:
        raise GGUFError(f"{key} is {value}, a negative count")
    return value


def _per_layer(meta: Mapping[str, Any], key: str, layers: int, default: int | None) -> tuple[int, ...]:
    value = meta.get(key)
    if value is None:
        if default is None:
            raise GGUFError(f"the header has no {key}")
        return (default,) * layers
    if isinstance(value, list):
        if len(value) != layers or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise GGUFError(f"{key} lists {len(value)} values; the model has {layers} layers")
        return tuple(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GGUFError(f"{key} is {value!r}, not a count")
    return (value,) * layers


def _companion_shape(meta: Mapping[str, Any], arch: str, kind: str) -> Shape:
    """The shape of an adapter or a multimodal projector: not a model to size, so what it is and the
    architecture it is for are what count."""
    adapter = meta.get("adapter.type")
    return Shape(
        architecture=arch,
        kind=kind,
        block_count=_int(meta, f"{arch}.block_count") or 0,
        embedding_length=_int(meta, f"{arch}.embedding_length") or 0,
        context_length=None,
        feed_forward_length=None,
        head_count=(),
        head_count_kv=(),
        key_length=(),
        value_length=(),
        swa_layers=(),
        sliding_window=None,
        kv_layers=(),
        adapter_type=str(adapter) if isinstance(adapter, str) else None,
    )


def _swa_layers(meta: Mapping[str, Any], arch: str, layers: int, window: int | None) -> tuple[bool, ...]:
    """Per layer, whether it attends over the sliding window only: the header's pattern where it
    lists one, else every layer but the last of each period (the architecture's, where the header
    gives none).  No layer without a window."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if not window:
        return (False,) * layers
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"{arch}.attention.sliding_window_pattern lists {len(pattern)} values for {layers} layers")
        return tuple(bool(p) for p in pattern)
    period = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else SWA_PERIOD.get(arch)
    # llama.cpp: a layer is SWA unless it is the last of its period (period 0: every layer is).
    return tuple(period is None or period == 0 or i % period < period - 1 for i in range(layers))


def shape_of(header: Header) -> Shape:
    """The model's shape as the estimate needs it, from its GGUF header (GGUFError when a count the
    estimate needs is missing or is not one)."""
    meta = header.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFError("the header has no general.architecture")
    kind = str(meta.get("general.type") or ("mmproj" if arch == "clip" else "model"))
    if kind in ("adapter", "mmproj"):
        return _companion_shape(meta, arch, kind)
    layers = _int(meta, f"{arch}.block_count", required=True) or 0
    if layers > 4096:
        raise GGUFError(f"{arch}.block_count is {layers:,}, more than any model has")
    embd = _int(meta, f"{arch}.embedding_length", required=True) or 0
    heads = _per_layer(meta, f"{arch}.attention.head_count", layers, None)
    heads_kv = _per_layer(meta, f"{arch}.attention.head_count_kv", layers, max(heads) if heads else 0)
    first = next((h for h in heads if h), 0)
    default_dim = embd // first if first else 0
    key = _int(meta, f"{arch}.attention.key_length") or default_dim
    value = _int(meta, f"{arch}.attention.value_length") or default_dim
    window = _int(meta, f"{arch}.attention.sliding_window")
    swa = _swa_layers(meta, arch, layers, window)
    key_swa = _int(meta, f"{arch}.attention.key_length_swa") or key
    value_swa = _int(meta, f"{arch}.attention.value_length_swa") or value
    keys = tuple(key_swa if s else key for s in swa)
    values = tuple(value_swa if s else value for s in swa)
    if _int(meta, f"{arch}.attention.key_length_mla"):
        # MLA caches the compressed latent once per layer (one "head" of the MLA lengths).
        heads_kv = tuple(1 if h else 0 for h in heads_kv)
        keys = (_int(meta, f"{arch}.attention.key_length_mla") or key,) * layers
        values = (_int(meta, f"{arch}.attention.value_length_mla") or 0,) * layers
    shared = _int(meta, f"{arch}.attention.shared_kv_layers") or 0
    kv_layers = tuple(i < layers - shared for i in range(layers))
    ff = meta.get(f"{arch}.feed_forward_length")
    feed_forward = max(ff) if isinstance(ff, list) and ff else ff if isinstance(ff, int) else None
    return Shape(
        architecture=arch,
        kind=kind,
        block_count=layers,
        embedding_length=embd,
        context_length=_int(meta, f"{arch}.context_length"),
        feed_forward_length=feed_forward,
        head_count=heads,
        head_count_kv=heads_kv,
        key_length=keys,
        value_length=values,
        swa_layers=swa,
        sliding_window=window or None,
        kv_layers=kv_layers,
        expert_count=_int(meta, f"{arch}.expert_count"),
        expert_used_count=_int(meta, f"{arch}.expert_used_count"),
        vocab_size=_int(meta, "tokenizer.ggml.tokens.count") or _int(meta, f"{arch}.vocab_size"),
        split_count=_int(meta, "split.count"),
        adapter_type=str(meta["adapter.type"]) if isinstance(meta.get("adapter.type"), str) else None,
    )


def _pad(n: int, to: int = KV_PAD) -> int:
    return -(-n // to) * to


def estimate(
    shape: Shape,
    weights: int,
    *,
    ctx_size: int,
    parallel: int = 1,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    kv_unified: bool = False,
    swa_full: bool = False,
    ubatch: int = UBATCH,
) -> Estimate:
    """What llama-server allocates for `shape` at `--ctx-size ctx_size --parallel parallel`."""
    if ctx_size <= 0 or parallel <= 0:
        raise ValueError(f"ctx_size and parallel must be positive, got {ctx_size} and {parallel}")
    try:
        bytes_k, bytes_v = CACHE_TYPES[cache_type_k], CACHE_TYPES[cache_type_v]
    except KeyError as exc:
        raise ValueError(f"unknown cache type {exc.args[0]!r} (known: {', '.join(CACHE_TYPES)})") from None
    streams = 1 if kv_unified else parallel
    per_stream = max(ctx_size // streams, 1)
    cells = _pad(per_stream)
    swa_cells = None
    if any(shape.swa_layers) and shape.sliding_window:
        window = shape.sliding_window * (parallel if kv_unified else 1)
        swa_cells = cells if swa_full else _pad(min(per_stream, window + ubatch))
    kv_full = kv_swa = 0.0
    for i in range(shape.block_count):
        if not shape.kv_layers[i] or not shape.head_count_kv[i]:
            continue
        per_cell = shape.head_count_kv[i] * (shape.key_length[i] * bytes_k + shape.value_length[i] * bytes_v)
        if shape.swa_layers[i] and swa_cells is not None:
            kv_swa += per_cell * swa_cells * streams
        else:
            kv_full += per_cell * cells * streams
    vocab = shape.vocab_size or 0
    output = parallel * vocab * 4
    # One ubatch through the feed-forward, the widest part of a layer (four f32 rows of its width
    # per token live at once), and the f16 attention masks (one per cache size).
    width = 4 * (shape.feed_forward_length or 4 * shape.embedding_length)
    masks = cells + (swa_cells or 0)
    compute = ubatch * width * 4 + ubatch * masks * 2
    return Estimate(
        weights=weights,
        kv=int(kv_full + kv_swa),
        kv_full=int(kv_full),
        kv_swa=int(kv_swa),
        cells=cells,
        swa_cells=swa_cells,
        streams=streams,
        output=output,
        compute=compute,
        overhead=FIXED_OVERHEAD,
    )


def weights_of(sizes: Sequence[int]) -> int:
    """The weights of a model held in one GGUF file or a split set: the files' sizes."""
    return sum(sizes)
