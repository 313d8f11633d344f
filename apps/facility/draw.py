"""What a shard draws by what is known of it (no Django): its cards' TDP, and the highest of what
is known (declared, derived, measured). apps.facility.power reads the measured part."""

from __future__ import annotations

import functools

__all__ = ["GPU_TDP_W", "derived_watts", "shard_watts", "tdp_watts"]

# Board power of one card by GPU class prefix (../shared/reference/fabrics-facility.md section 7),
# longest prefix first so that H100-NVL is not read as an H100 SXM.
GPU_TDP_W: tuple[tuple[str, int], ...] = (
    ("GB300", 1400),
    ("B300", 1400),
    ("GB200", 1200),
    ("B200", 1000),
    ("H200-NVL", 600),
    ("H200", 700),
    ("H100-NVL", 400),
    ("H100-PCIE", 350),
    ("H100", 700),
    ("A100", 400),
    ("L40S", 350),
    ("L40", 300),
    ("L4", 72),
)


@functools.lru_cache(maxsize=256)
def tdp_watts(gpu_class: str) -> int | None:
    upper = gpu_class.upper()
    for prefix, watts in GPU_TDP_W:
        if upper.startswith(prefix):
            return watts
    return None


def derived_watts(gpu_class: str | None, gpus: int) -> int | None:
    """The cards' TDP for a shard of `gpus` cards of the class (None: unknown class, or no cards)."""
    if not gpu_class or gpus <= 0:
        return None
    tdp = tdp_watts(gpu_class)
    return tdp * gpus if tdp is not None else None


def shard_watts(*known: float | None) -> float | None:
    """The highest of what is known of a shard's draw; None when nothing is."""
    values = [float(v) for v in known if isinstance(v, int | float)]
    return max(values) if values else None
