from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["CapacityClass", "Engine"]


class CapacityClass(models.TextChoices):
    """What may be stopped to make room: a lower class for a higher one."""

    UNSET = "", _("follows its scaling")
    CRITICAL = "critical", _("critical")
    STANDARD = "standard", _("standard")
    OPPORTUNISTIC = "opportunistic", _("opportunistic")


CLASS_RANK = {CapacityClass.OPPORTUNISTIC: 0, CapacityClass.STANDARD: 1, CapacityClass.CRITICAL: 2}


class Engine(models.TextChoices):
    LLAMA_CPP = "llama.cpp", "llama.cpp"
    VLLM = "vllm", "vLLM"
    SGLANG = "sglang", "SGLang"
