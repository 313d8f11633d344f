"""The agent `llmgw up` runs on its own machine: its engine binary and its agent.yaml."""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

from django.conf import settings

__all__ = ["find_llama_server", "local_agent_config", "model_dirs"]


def find_llama_server() -> str | None:
    """A llama.cpp server for this machine's own agent: LLMGW_LLAMA_SERVER, PATH, or a local build."""
    candidates = [
        os.environ.get("LLMGW_LLAMA_SERVER"),
        shutil.which("llama-server"),
        str(settings.BASE_DIR.parent / "shared" / "bin" / "llama-server"),
    ]
    candidates += sorted(str(p) for p in Path("~/.cache/llmgw/llama-server").expanduser().glob("*/llama-server"))
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def model_dirs(data_dir: Path) -> list[str]:
    """Where this machine's own agent keeps models: `<data_dir>/models`, and the mirror's node
    directory (LLMGW_MIRROR_NODE_DIR) when it was set outside that, so that a model served from the
    mirror is fetched here rather than refused."""
    models = data_dir / "models"
    dirs = [str(models)]
    mirror = Path(settings.MIRROR_NODE_DIR)
    if mirror.is_absolute() and not mirror.is_relative_to(models):
        dirs.append(str(mirror))
    return dirs


def local_agent_config(data_dir: Path, base_url: str) -> Path:
    """Write the agent.yaml (and credential) of this machine's own agent, once: enrolled without
    a token, looking for weights in `<data_dir>/models` (which holds the mirror's node directory,
    `<data_dir>/models/mirror`, unless LLMGW_MIRROR_NODE_DIR names another: then that too)."""
    import yaml

    from apps.cluster.enrolment import authenticate_node, issue_credential, validate_node_name

    folder = data_dir / "agent"
    folder.mkdir(parents=True, exist_ok=True)
    credential_file = folder / "credential"
    config_path = folder / "agent.yaml"
    name = validate_node_name(re.sub(r"[^a-z0-9.-]", "-", socket.gethostname().lower()).strip("-.") or "local")
    existing = credential_file.read_text().strip() if credential_file.exists() else ""
    if not existing or authenticate_node(existing) is None:
        _node, credential = issue_credential(name, labels={"llmgw.io/local": "true"})
        credential_file.write_text(credential)
        credential_file.chmod(0o600)
    config: dict[str, Any] = {
        "server": base_url,
        "state_dir": str(folder),
        "model_dirs": model_dirs(data_dir),
        "labels": {},
    }
    engine = find_llama_server()
    if engine:
        config["engines"] = {"llama.cpp": engine}
    (data_dir / "models").mkdir(exist_ok=True)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return config_path
