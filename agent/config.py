"""agent.yaml: what an operator writes on each node.

server: https://llm.example.com        # the control plane (required)
token: llmgwe_...                      # one-time enrollment token (first start only)
state_dir: /var/lib/llmgw-agent        # keeps the node credential (0600)
labels: {llmgw.io/rack: r12}
model_dirs: [/models, /mnt/filer/models]
heartbeat_interval: 10                 # seconds; the server's value wins once registered
root: /                                # where /proc and /sys are read (tests point it elsewhere)
tools: {nvidia-smi: /usr/bin/nvidia-smi, dmesg: dmesg}
fabrics: [{name: ib-a, hcas: [mlx5_0, mlx5_1]}]   # declared fabrics and their adapters (or netdevs)
fabric_check_interval: 60              # seconds between asking each port for its subnet manager
fabric_change_interval: 30             # a change of the fabrics the node carries is said at most this often
gpu_check_interval: 60                 # seconds between reads of NVLink counters, XIDs and IMEX
sample_interval: 10                    # a sample of the node (GPUs, CPU, memory, power) is taken at most this often
engines: {llama.cpp: /opt/llama/llama-server}   # named on purpose: used as is, never replaced
engine_recheck_interval: 600           # seconds between checks of the engines llmgw installed
engine_retry_after: 60                 # seconds before a failed engine install is tried again
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["AgentConfig", "ConfigError", "load_config", "parse_config"]

DEFAULT_TOOLS = {"nvidia-smi": "nvidia-smi", "dmesg": "dmesg", "ldd": "ldd", "apt-get": "apt-get"}


class ConfigError(ValueError):
    pass


@dataclass
class AgentConfig:
    server: str
    state_dir: Path
    token: str | None = None
    name: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    model_dirs: list[str] = field(default_factory=list)
    heartbeat_interval: float = 10.0
    root: str = "/"
    tools: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_TOOLS))
    fabrics: list[dict[str, Any]] = field(default_factory=list)
    engines: dict[str, str] = field(default_factory=dict)
    hostname: str | None = None
    engine_recheck_interval: float = 600.0
    engine_retry_after: float = 60.0
    fabric_check_interval: float = 60.0
    fabric_change_interval: float = 30.0
    gpu_check_interval: float = 60.0
    sample_interval: float = 10.0
    # The address the control plane and gateway reach this node's engines at (else the address
    # its websocket comes from).
    advertise_address: str | None = None

    @property
    def credential_file(self) -> Path:
        return self.state_dir / "credential"

    @property
    def websocket_url(self) -> str:
        base = self.server.rstrip("/")
        if base.startswith("https://"):
            base = "wss://" + base[len("https://") :]
        elif base.startswith("http://"):
            base = "ws://" + base[len("http://") :]
        return base + "/ws/agent/"


def _expect(data: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = data.get(key)
    if value is not None and not isinstance(value, kind):
        raise ConfigError(f"{key}: expected {what}, got {type(value).__name__}")
    return value


#: Every setting agent.yaml may hold; anything else is refused as a typo.
SETTINGS = frozenset(
    {
        "server",
        "token",
        "state_dir",
        "name",
        "labels",
        "model_dirs",
        "heartbeat_interval",
        "root",
        "tools",
        "fabrics",
        "engines",
        "hostname",
        "advertise_address",
        "engine_recheck_interval",
        "engine_retry_after",
        "fabric_check_interval",
        "fabric_change_interval",
        "gpu_check_interval",
        "sample_interval",
    }
)
#: The intervals of the node's checks: (setting, default, the least it may be), at most a day.
CHECK_INTERVALS = (
    ("fabric_check_interval", 60.0, 1),
    ("fabric_change_interval", 30.0, 0),
    ("gpu_check_interval", 60.0, 1),
    ("sample_interval", 10.0, 1),
)


def parse_config(data: Any, *, base_dir: Path | None = None) -> AgentConfig:
    """The agent's configuration from agent.yaml's mapping; ConfigError names the first setting that
    is wrong (settings are checked in a fixed order).  A relative state_dir is taken from
    ``base_dir`` when given."""
    if not isinstance(data, dict):
        raise ConfigError("agent.yaml must be a mapping of settings")
    unknown = sorted(set(data) - SETTINGS)
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(unknown)} (known: {', '.join(sorted(SETTINGS))})")
    server = _expect(data, "server", str, "a URL")
    if not server or not server.startswith(("http://", "https://")):
        raise ConfigError("server: required, a URL starting with http:// or https://")
    state_dir = Path(_expect(data, "state_dir", str, "a directory path") or "/var/lib/llmgw-agent")
    if base_dir is not None and not state_dir.is_absolute():
        state_dir = base_dir / state_dir
    labels = _expect(data, "labels", dict, "a mapping of label names to values") or {}
    model_dirs = _expect(data, "model_dirs", list, "a list of directories") or []
    heartbeat = _seconds(data, "heartbeat_interval", 10.0, 1, 300)
    tools = dict(DEFAULT_TOOLS)
    tools.update(
        {str(k): str(v) for k, v in (_expect(data, "tools", dict, "a mapping of tool names to paths") or {}).items()}
    )
    recheck = _seconds(data, "engine_recheck_interval", 600.0, 1)
    retry = _seconds(data, "engine_retry_after", 60.0, 1)
    fabrics = _fabrics(data)
    intervals = {key: _seconds(data, key, default, low) for key, default, low in CHECK_INTERVALS}
    return AgentConfig(
        server=server,
        state_dir=state_dir,
        token=_expect(data, "token", str, "an enrollment token"),
        name=_expect(data, "name", str, "a node name"),
        labels={str(k): str(v) for k, v in labels.items()},
        model_dirs=[str(d) for d in model_dirs],
        heartbeat_interval=heartbeat,
        root=_expect(data, "root", str, "a directory path") or "/",
        tools=tools,
        fabrics=fabrics,
        engines={str(k): str(v) for k, v in (_expect(data, "engines", dict, "a mapping") or {}).items()},
        hostname=_expect(data, "hostname", str, "a host name"),
        advertise_address=_expect(data, "advertise_address", str, "an address"),
        engine_recheck_interval=recheck,
        engine_retry_after=retry,
        **intervals,
    )


def _seconds(data: dict[str, Any], key: str, default: float, low: int, high: int = 86400) -> float:
    """A setting in seconds, from ``low`` to ``high``; ``default`` when it is not set."""
    value = _expect(data, key, (int, float), "a number of seconds")
    if value is not None and not low <= value <= high:
        raise ConfigError(f"{key}: expected {low} to {high} seconds, got {value}")
    return float(default if value is None else value)


def _fabrics(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The declared fabrics: each a mapping with a name and lists of adapter (hcas) or network
    device (netdevs) names."""
    fabrics: list[dict[str, Any]] = _expect(data, "fabrics", list, "a list of fabrics") or []
    for i, fabric in enumerate(fabrics):
        if not isinstance(fabric, dict) or not fabric.get("name"):
            raise ConfigError(f"fabrics[{i}]: expected a mapping with a name")
        stray = sorted(set(fabric) - {"name", "hcas", "netdevs"})
        if stray:
            raise ConfigError(
                f"fabrics[{i}]: unknown setting(s): {', '.join(map(str, stray))} (known: hcas, name, netdevs)"
            )
        for key in ("hcas", "netdevs"):
            value = fabric.get(key)
            if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
                raise ConfigError(f"fabrics[{i}].{key}: expected a list of names")
    return fabrics


def load_config(path: str | os.PathLike[str]) -> AgentConfig:
    import yaml

    target = Path(path)
    try:
        text = target.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {target}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{target} is not valid YAML: {exc}") from None
    return parse_config(data, base_dir=target.parent)
