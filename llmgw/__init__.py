"""llmgw: one private LLM service over an organisation's own GPU and CPU servers."""

from __future__ import annotations

__version__ = "0.1.0"
