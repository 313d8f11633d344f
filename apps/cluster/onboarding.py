"""A node joins with one command that it fetches from the control plane itself.

`llmgw ctl node add NAME` (and the console's form) print

    curl -fsSL https://llm.example.com/install/node.sh | sudo LLMGW_TOKEN=llmgwe_... sh

The script (`install_script`) downloads the agent from the control plane, not from a package
index: `llmgw-agent.pyz`, one zip application (Python's zipapp) holding the agent and the two
pure-Python libraries it needs (websockets and PyYAML, their optional C speedups left out), built
from this installation's own code (`agent_bundle`), with its sha256 beside it. The script checks
the digest, writes /etc/llmgw/agent.yaml (unless one exists), a systemd unit, runs `doctor`, and
starts the agent. The node needs python3 (3.11 or newer), curl and sha256sum, nothing more.

LLMGW_PREFIX (/opt/llmgw), LLMGW_CONFIG_DIR (/etc/llmgw), LLMGW_STATE_DIR (/var/lib/llmgw-agent)
and LLMGW_NO_SYSTEMD=1 (start the agent in the background instead of a unit) change where it goes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import threading
import zipfile
from pathlib import Path

from django.conf import settings

__all__ = ["AGENT_CONFIG_PATH", "AGENT_STATE_DIR", "agent_bundle", "agent_yaml", "install_command", "install_script"]

AGENT_CONFIG_PATH = "/etc/llmgw/agent.yaml"
AGENT_STATE_DIR = "/var/lib/llmgw-agent"

#: The packages the bundle carries: the agent, and what it imports.
PACKAGES = ("agent", "websockets", "yaml")
_lock = threading.Lock()


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"cannot find the {name} package to bundle")
    return Path(next(iter(spec.submodule_search_locations)))


def _sources() -> list[tuple[str, Path]]:
    files = []
    for package in PACKAGES:
        root = _package_dir(package)
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            files.append((f"{package}/{path.relative_to(root).as_posix()}", path))
    return files


def _fingerprint(files: list[tuple[str, Path]]) -> str:
    digest = hashlib.sha256()
    for name, path in files:
        stat = path.stat()
        digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def agent_bundle() -> tuple[Path, str]:
    """The agent's one-file bundle and its sha256, built again when the code changed."""
    folder = Path(settings.DATA_DIR) / "node-install"
    files = _sources()
    key = _fingerprint(files)
    bundle = folder / "llmgw-agent.pyz"
    stamp = folder / "llmgw-agent.pyz.key"
    sidecar = folder / "llmgw-agent.pyz.sha256"
    with _lock:
        try:
            if stamp.read_text() == key and bundle.exists():
                return bundle, sidecar.read_text().split()[0]
        except (OSError, IndexError):
            pass
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".llmgw-agent.{os.getpid()}.pyz"
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("__main__.py", "import sys\n\nfrom agent.cli import main\n\nsys.exit(main())\n")
            for name, path in files:
                archive.write(path, name)
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        os.replace(tmp, bundle)
        sidecar.write_text(f"{digest}  llmgw-agent.pyz\n")
        stamp.write_text(key)
        return bundle, digest


def agent_yaml(server: str, secret: str, labels: dict[str, str]) -> str:
    """The agent.yaml for a node where llmgw is installed already (the one-line install writes its own)."""
    import yaml

    return yaml.safe_dump(
        {"server": server, "token": secret, "state_dir": AGENT_STATE_DIR, "labels": labels, "model_dirs": []},
        sort_keys=False,
        allow_unicode=True,
    )


def install_command(server: str, token: str) -> str:
    """The one line an operator runs on the new node."""
    return (
        f"curl -fsSL {shlex.quote(server.rstrip('/') + '/install/node.sh')} | sudo LLMGW_TOKEN={shlex.quote(token)} sh"
    )


def install_script(server: str) -> str:
    """The POSIX shell script behind that line (install_node.sh), for this control plane."""
    text = (Path(__file__).with_name("install_node.sh")).read_text()
    return text.replace("@SERVER@", shlex.quote(server.rstrip("/")))
