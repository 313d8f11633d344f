"""What a GPU class's name says of the device (no Django).

A slice's class is its card's class and its profile: a MIG profile ("H100-80GB-1g.10gb",
"-2c.3g.71gb") or an AMD compute partition ("MI300X-192GB-cpx.nps4"). Placement, held GPU time
(apps.quotas) and a shard's derived power draw (apps.facility) all count a slice as its share of
its card, so the share is read here, below all three.
"""

from __future__ import annotations

import functools
import re

__all__ = ["class_share"]

_MIG_RE = re.compile(r"-(?:(?P<ci>\d{1,2})c\.)?(?P<g>\d{1,2})g\.\d{1,4}gb(?:\+[a-z0-9]{1,8})*$", re.ASCII)
_PARTITION_RE = re.compile(r"-(?P<mode>[sdtqc]px)\.nps\d$", re.ASCII)
_PARTITIONS = {"spx": 1, "dpx": 2, "tpx": 3, "qpx": 4, "cpx": 8}


@functools.lru_cache(maxsize=256)
def class_share(gpu_class: str) -> float:
    """The part of a card one device of the class is: 1 for a whole card, a MIG slice's compute
    slices of its card's (a 1g of an H100 = 1/7, of an A30 = 1/4), a compute partition's 1/n."""
    mig = _MIG_RE.search(gpu_class)
    if mig is not None:
        slots = 4 if gpu_class.upper().startswith("A30") else 7
        return min(int(mig.group("ci") or mig.group("g")), slots) / slots
    partition = _PARTITION_RE.search(gpu_class.lower())
    return 1 / _PARTITIONS[partition.group("mode")] if partition is not None else 1.0
