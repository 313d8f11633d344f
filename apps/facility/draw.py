"""What a shard draws by what is known of it (no Django): its cards' TDP, and the highest of what
is known (declared, derived, measured). apps.facility.power reads the measured part; a slice's
share of its card is apps.cluster.gpu_classes.class_share."""

from __future__ import annotations

import functools

from apps.cluster.gpu_classes import class_share

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
    # AMD Instinct (OAM boards' TBP)
    ("MI355X", 1400),
    ("MI350X", 1000),
    ("MI325X", 1000),
    ("MI300X", 750),
    ("MI300A", 550),
    ("MI250X", 560),
    ("MI210", 300),
    ("MI100", 300),
)


@functools.lru_cache(maxsize=256)
def tdp_watts(gpu_class: str) -> int | None:
    upper = gpu_class.upper()
    for prefix, watts in GPU_TDP_W:
        if upper.startswith(prefix):
            return watts
    return None


def derived_watts(gpu_class: str | None, gpus: int) -> int | None:
    """The TDP of `gpus` devices of the class (a slice: its share of its card's), None for an unknown
    class or no device."""
    if not gpu_class or gpus <= 0:
        return None
    tdp = tdp_watts(gpu_class)
    return round(tdp * gpus * class_share(gpu_class)) if tdp is not None else None


def shard_watts(*known: float | None) -> float | None:
    """The highest of what is known of a shard's draw; None when nothing is."""
    values = [float(v) for v in known if isinstance(v, int | float)]
    return max(values) if values else None
