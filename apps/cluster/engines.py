"""Which engines every node should have, decided here; the nodes install them.

- Choices (`EngineChoice`): per engine, a version for every node, for a GPU class, for nodes
  with a label, or for one node; the most specific rule that matches a node wins (node, label,
  GPU class, every node), and without any the version this release was checked against
  (`DEFAULT_VERSIONS`). Version "none" keeps an engine off; so does the node's own
  `disabled_engines` (`llmgw ctl node add --disable-engine`). `engines:` in server.yaml states
  the whole set of choices, applied at start like `models:`.
- Releases (`EngineRelease`): the asset listing of each wanted version, read once from the
  releases API (GitHub's `GET /repos/<repo>/releases/tags/<tag>`) by the worker and kept, so
  nodes never call GitHub (60 calls an hour without a token).
- Held archives (`ENGINE_FILES_DIR`): what `llmgw engine-files add` copied in or `llmgw
  engine-files fetch TAG` fetched once for the fleet (the builds its nodes need), each with the
  digest it was stored with. The control plane is a source on its own: a held archive of the
  release (by name, `llama-<tag>-bin-...`) is offered at its own URL whatever GitHub says, first
  and with the listing's digest where a listing was read (a held copy the listing disagrees with
  is not offered), alone with its stored digest where none could be. Where neither a listing nor
  a held archive that suits a node can be had, the node is told the command that fixes it (`fix`),
  and its page says so (`offer_problem`).
- `desired_engines(node)` is what goes to the node with its shards, in the "desired" message.
- vLLM and SGLang are Python environments the node builds with uv (agent/install/pyenv.py). They
  install only where a choice names a version (no default: they are gigabytes and need a GPU).
  The control plane relays the engine's release listing (its `+cuNNN` wheels) and uv's, the
  node's build choice (`Node.engine_build`: auto, cu13, cu129, none), the oldest GPU generation
  the version is built for, and, for a node whose GPUs are older than that, the newest version
  built for them instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from agent import protocol
from agent.bounded import size_text
from agent.install.builds import NodeFacts, choose_builds, parse_assets
from apps.accounts import audit
from apps.cluster.models import EngineChoice, EngineRelease, Node
from llmgw import outbound
from llmgw.errors import ServiceError

__all__ = [
    "DEFAULT_VERSIONS",
    "EngineTables",
    "FleetFetch",
    "HeldFile",
    "ENGINE_NAMES",
    "ENGINE_REPOS",
    "EngineConfigError",
    "apply_engine_config",
    "apply_server_engines",
    "choices_for",
    "desired_engines",
    "fetch_held",
    "fetch_release",
    "fetch_wanted_releases",
    "held_file",
    "held_files",
    "nodes_changed",
    "offer_problem",
    "offered_assets",
    "remove_choice",
    "parse_engine_config",
    "set_choice",
    "store_file",
    "wanted_versions",
]

log = logging.getLogger(__name__)

#: The engines the agent installs, and where their releases are published.
ENGINE_REPOS = {"llama.cpp": "ggml-org/llama.cpp", "vllm": "vllm-project/vllm", "sglang": "sgl-project/sglang"}
#: Their names in the order the API offers them (one enum, EngineNameEnum, in its schema).
ENGINE_NAMES = tuple(sorted(ENGINE_REPOS))
#: Engines that are Python environments built by uv on the node.
PYTHON_ENGINES = frozenset({"vllm", "sglang"})
#: Tools the nodes install with those engines, where they are published, and the version used.
TOOL_REPOS = {"uv": "astral-sh/uv"}
UV_VERSION = "0.13.9"
#: How each project writes a version as a release tag.
TAG_FORMAT = {"vllm": "v{version}", "sglang": "v{version}"}
#: The compute capability current vLLM builds need (T4 and newer); versions up to 0.11 were
#: still built for Volta (7.0). A node whose GPUs are older than a version's floor gets the
#: newest version built for them.
VLLM_MIN_COMPUTE = (7, 5)
VLLM_OLDER_GPUS = (((7, 0), "0.11.0"),)
SGLANG_MIN_COMPUTE = (7, 5)
#: The version of each engine this release of llmgw was checked against: what a node gets when
#: no choice names another.
DEFAULT_VERSIONS = {"llama.cpp": "b10991"}
#: Where a CPU node compiles llama.cpp when no release archive can be had: the source
#: distribution scripts/ensure-llama-server builds (llama.cpp 0c1e570, vendored), by its digest.
SOURCE_BUILDS: dict[str, dict[str, str]] = {
    "llama.cpp": {
        "package": "llama-cpp-python",
        "version": "0.3.36",
        "sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        "subdir": "vendor/llama.cpp",
    }
}
#: How each engine's release names its archives: a held file of that name belongs to the release.
HELD_PREFIXES = {"llama.cpp": ("llama-{version}-bin-", "cudart-llama-{version}-bin-")}
#: The most one archive fetched for the fleet may be when its listing gives no size.
MAX_HELD_BYTES = 8 * 2**30
NONE = "none"
RETRY_FAILED_AFTER_S = 600.0
FETCH_TIMEOUT_S = 30.0
#: The most of a releases API answer read: a release lists a few dozen assets in some tens of kB.
MAX_LISTING_BYTES = 16 * 2**20
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
_SCOPE_KEYS = {
    "gpu_class": EngineChoice.Scope.GPU_CLASS,
    "label": EngineChoice.Scope.LABEL,
    "node": EngineChoice.Scope.NODE,
}
_SPECIFICITY = {
    EngineChoice.Scope.NODE: 0,
    EngineChoice.Scope.LABEL: 1,
    EngineChoice.Scope.GPU_CLASS: 2,
    EngineChoice.Scope.ALL: 3,
}


class EngineConfigError(ServiceError, ValueError):
    """An engine choice that cannot be taken; str() names the field and why."""

    code = "engine_config_invalid"


@dataclass(frozen=True)
class Rule:
    engine: str
    version: str
    scope: str
    match: str


# --------------------------------------------------------------------------- choices


def check_engine(engine: str) -> str:
    if engine not in ENGINE_REPOS:
        raise EngineConfigError(
            _("unknown engine %(engine)s (llmgw installs: %(known)s)")
            % {"engine": engine, "known": ", ".join(sorted(ENGINE_REPOS))}
        )
    return engine


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in re.split(r"[.+-]", version.lstrip("v")):
        if not (piece.isascii() and piece.isdigit()):  # "²" passes isdigit() and fails int()
            break
        parts.append(int(piece))
    return tuple(parts)


def min_compute(engine: str, version: str) -> tuple[int, int] | None:
    """The oldest GPU generation (compute capability) a version of a Python engine is built for."""
    if engine == "vllm":
        return (7, 0) if (0,) < _version_tuple(version) < (0, 12) else VLLM_MIN_COMPUTE
    if engine == "sglang":
        return SGLANG_MIN_COMPUTE
    return None


def oldest_gpu(node: Node) -> tuple[int, int] | None:
    """The lowest compute capability among the node's GPUs, from its hardware report."""
    from agent.install.builds import compute_capability

    gpus = (node.hardware or {}).get("gpus") or []
    known = [cc for gpu in gpus if isinstance(gpu, Mapping) and (cc := compute_capability(gpu)) is not None]
    if not known:
        known = [cc for gpu in node.gpus.all() if (cc := compute_capability({"name": gpu.name})) is not None]
    return min(known) if known else None


def _for_older_gpus(engine: str, version: str, oldest: tuple[int, int] | None) -> tuple[str, str] | None:
    """(version, why) when the node's GPUs are older than `version` is built for and an older
    version still runs on them."""
    floor = min_compute(engine, version)
    if engine != "vllm" or oldest is None or floor is None or oldest >= floor:
        return None
    for cc, older in VLLM_OLDER_GPUS:
        if oldest >= cc and _version_tuple(older) < _version_tuple(version):
            why = _("the newest vLLM built for compute capability %(have)s (%(version)s needs %(floor)s or newer)") % {
                "have": _cc(oldest),
                "version": version,
                "floor": _cc(floor),
            }
            return older, why
    return None


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def check_version(version: Any, where: str) -> str:
    if not isinstance(version, str) or not _VERSION_RE.match(version):
        raise EngineConfigError(
            _("%(where)s: expected a release tag such as %(example)s, or “none”, got %(value)r")
            % {"where": where, "example": DEFAULT_VERSIONS["llama.cpp"], "value": version}
        )
    return version


def check_match(scope: str, match: str) -> str:
    if scope == EngineChoice.Scope.ALL:
        return ""
    if not match or len(match) > 300 or "\x00" in match:
        raise EngineConfigError(_("%(scope)s: a value is needed") % {"scope": scope})
    if scope == EngineChoice.Scope.LABEL and "=" not in match:
        raise EngineConfigError(_("label: expected key=value, got %(value)r") % {"value": match})
    return match


def parse_engine_config(data: Any) -> list[Rule]:
    """server.yaml's `engines:`, strictly: unknown keys and engines are errors with their path.

    engines:
      llama.cpp: b10991            # every node
      overrides:
        - gpu_class: H100-80GB     # or `node: n3`, or `label: rack=r12`
          llama.cpp: b11070        # or none
    """
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise EngineConfigError(_("engines: expected a mapping of engine names to versions"))
    rules: list[Rule] = []
    for key, value in data.items():
        if key == "overrides":
            if not isinstance(value, list):
                raise EngineConfigError(_("engines.overrides: expected a list"))
            for i, item in enumerate(value):
                rules += _parse_override(item, f"engines.overrides[{i}]")
            continue
        check_engine(str(key))
        rules.append(Rule(str(key), check_version(value, f"engines.{key}"), EngineChoice.Scope.ALL, ""))
    return rules


def _parse_override(item: Any, where: str) -> list[Rule]:
    if not isinstance(item, Mapping):
        raise EngineConfigError(_("%(where)s: expected a mapping") % {"where": where})
    scopes = [k for k in item if k in _SCOPE_KEYS]
    if len(scopes) != 1:
        raise EngineConfigError(_("%(where)s: name exactly one of gpu_class, label or node") % {"where": where})
    scope = _SCOPE_KEYS[scopes[0]]
    match = check_match(scope, str(item[scopes[0]]))
    rules = []
    for key, value in item.items():
        if key == scopes[0]:
            continue
        if key not in ENGINE_REPOS:
            raise EngineConfigError(
                _("%(where)s.%(key)s: unknown field (expected gpu_class, label or node, and engine names: %(known)s)")
                % {"where": where, "key": key, "known": ", ".join(sorted(ENGINE_REPOS))}
            )
        rules.append(Rule(key, check_version(value, f"{where}.{key}"), scope, match))
    if not rules:
        raise EngineConfigError(_("%(where)s: names no engine") % {"where": where})
    return rules


def apply_server_engines(path: str) -> list[Rule] | None:
    """server.yaml's `engines:` (None when the file has none: the choices stay as they are)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise EngineConfigError(str(exc)) from None
    if not isinstance(data, dict) or "engines" not in data:
        return None
    return apply_engine_config(data["engines"])


@transaction.atomic
def apply_engine_config(data: Any) -> list[Rule]:
    """Make the choices exactly what server.yaml's `engines:` states (it states the whole set)."""
    rules = parse_engine_config(data)
    keep = set()
    changed = False
    for rule in rules:
        before = EngineChoice.objects.filter(engine=rule.engine, scope=rule.scope, match=rule.match).first()
        choice, _created = EngineChoice.objects.update_or_create(
            engine=rule.engine, scope=rule.scope, match=rule.match, defaults={"version": rule.version}
        )
        keep.add(choice.pk)
        if before is None or before.version != rule.version:
            changed = True
            audit.record(
                None, "engine.set", choice, changes={"version": [before.version if before else None, rule.version]}
            )
    for gone in EngineChoice.objects.exclude(pk__in=keep):
        changed = True
        audit.record(None, "engine.remove", gone, changes={"version": [gone.version, None]})
        gone.delete()
    if changed:
        transaction.on_commit(lambda: nodes_changed(None))
    return rules


@transaction.atomic
def set_choice(
    engine: str,
    version: str,
    scope: str = EngineChoice.Scope.ALL,
    match: str = "",
    *,
    actor: Any = None,
    address: str | None = None,
) -> EngineChoice:
    check_engine(engine)
    check_version(version, "version")
    if scope not in EngineChoice.Scope.values:
        raise EngineConfigError(_("scope: expected one of %(known)s") % {"known": ", ".join(EngineChoice.Scope.values)})
    match = check_match(scope, match)
    before = EngineChoice.objects.filter(engine=engine, scope=scope, match=match).first()
    choice, _created = EngineChoice.objects.update_or_create(
        engine=engine, scope=scope, match=match, defaults={"version": version}
    )
    audit.record(
        actor,
        "engine.set",
        choice,
        changes={"version": [before.version if before else None, version]},
        address=address,
    )
    transaction.on_commit(lambda: nodes_changed(None))
    return choice


@transaction.atomic
def remove_choice(
    engine: str,
    scope: str = EngineChoice.Scope.ALL,
    match: str = "",
    *,
    actor: Any = None,
    address: str | None = None,
) -> int:
    choice = EngineChoice.objects.filter(engine=engine, scope=scope, match=match if scope != "all" else "").first()
    if choice is None:
        return 0
    audit.record(actor, "engine.remove", choice, changes={"version": [choice.version, None]}, address=address)
    choice.delete()
    transaction.on_commit(lambda: nodes_changed(None))
    return 1


def _node_gpu_classes(node: Node) -> set[str]:
    return {gpu.gpu_class for gpu in node.gpus.all() if gpu.gpu_class}


def choices_for(node: Node, rules: Iterable[EngineChoice] | None = None) -> dict[str, tuple[str, str]]:
    """Engine -> (version, why) for this node; version "none" where the engine is kept off."""
    rules = list(EngineChoice.objects.all() if rules is None else rules)
    labels = {f"{k}={v}" for k, v in (node.labels or {}).items()}
    classes = _node_gpu_classes(node)
    out: dict[str, tuple[str, str]] = {
        engine: (version, _("the version this release was checked against"))
        for engine, version in DEFAULT_VERSIONS.items()
    }
    best: dict[str, int] = {}
    for rule in rules:
        if rule.scope == EngineChoice.Scope.NODE and rule.match != node.name:
            continue
        if rule.scope == EngineChoice.Scope.LABEL and rule.match not in labels:
            continue
        if rule.scope == EngineChoice.Scope.GPU_CLASS and rule.match not in classes:
            continue
        rank = _SPECIFICITY[EngineChoice.Scope(rule.scope)]
        if rule.engine in best and best[rule.engine] <= rank:
            continue
        best[rule.engine] = rank
        out[rule.engine] = (rule.version, str(rule))
    for engine in node.disabled_engines or []:
        if engine in out:
            out[engine] = (NONE, _("disabled on this node"))
    for engine in PYTHON_ENGINES & set(out):
        version = out[engine][0]
        if version == NONE:
            continue
        if node.engine_build == Node.EngineBuild.NONE:
            out[engine] = (NONE, _("this node's vLLM/SGLang build is set to none"))
        elif older := _for_older_gpus(engine, version, oldest_gpu(node)):
            out[engine] = older
    return out


def wanted_versions() -> set[tuple[str, str]]:
    """Every (engine, version) some node should install now (not those whose agent.yaml names
    the engine's binary on purpose: they run that one)."""
    rules = list(EngineChoice.objects.all())
    wanted: set[tuple[str, str]] = set()
    nodes = Node.objects.filter(revoked_at__isnull=True).only(
        "name", "labels", "disabled_engines", "hardware", "engine_build"
    )
    for node in nodes.prefetch_related("gpus"):
        sources = node.hardware.get("engine_sources") or {}
        for engine, (version, _why) in choices_for(node, rules).items():
            if version != NONE and sources.get(engine) != "configured":
                wanted.add((engine, version))
                if engine in PYTHON_ENGINES:
                    wanted.add(("uv", UV_VERSION))
    return wanted


# --------------------------------------------------------------------------- what nodes get


def held_file(name: str) -> Path | None:
    """The control plane's own copy of an archive, when it holds one."""
    if "/" in name or name.startswith(".") or not name:
        return None
    path = Path(settings.ENGINE_FILES_DIR) / name
    return path if path.is_file() else None


def _held_digest(path: Path) -> str | None:
    sidecar = path.with_name(path.name + ".sha256")
    try:
        digest = sidecar.read_text().split()[0].lower()
    except (OSError, IndexError):
        return None
    return digest if re.fullmatch(r"[0-9a-f]{64}", digest) else None


@dataclass(frozen=True)
class HeldFile:
    """An archive in ENGINE_FILES_DIR, with the sha256 it was stored with (its `.sha256` beside it)."""

    name: str
    size: int
    sha256: str


def held_files() -> dict[str, HeldFile]:
    """Every archive the control plane holds and may offer, by name: one without a readable digest
    beside it is never offered (a node checks every download against one)."""
    folder = Path(settings.ENGINE_FILES_DIR)
    held: dict[str, HeldFile] = {}
    try:
        paths = sorted(folder.iterdir())
    except OSError:
        return held
    for path in paths:
        if path.name.startswith(".") or path.name.endswith(".sha256") or not path.is_file():
            continue
        digest = _held_digest(path)
        if digest is not None:
            held[path.name] = HeldFile(path.name, path.stat().st_size, digest)
    return held


def _belongs(engine: str, version: str, name: str) -> bool:
    return name.startswith(tuple(prefix.format(version=version) for prefix in HELD_PREFIXES.get(engine, ())))


def file_url(name: str) -> str:
    """Relative: the agent resolves it against the server it connects to, and sends its credential."""
    return f"/api/v1/engine-files/{name}"


def offered_assets(
    engine: str, version: str, release: EngineRelease | None, held: Mapping[str, HeldFile]
) -> list[dict[str, Any]]:
    """What a node is offered of a release: the listing's assets when it was read (the held copy
    first, where its digest is the listing's), and the held archives of the release it does not
    list, or all of them when there is no listing, each with the digest it was stored with."""
    out = []
    mine = {name: f for name, f in held.items() if _belongs(engine, version, name)}
    listed = release.assets if release is not None and release.fetched_at is not None else []
    for asset in listed or []:
        if not isinstance(asset, dict) or not isinstance(asset.get("name"), str):
            continue
        urls = []
        mine.pop(asset["name"], None)
        copy = held.get(asset["name"])
        digest = asset.get("digest")
        if copy is not None and isinstance(digest, str) and copy.sha256 == digest.split(":", 1)[-1].lower():
            urls.append(file_url(asset["name"]))
        if isinstance(asset.get("browser_download_url"), str):
            urls.append(asset["browser_download_url"])
        out.append({"name": asset["name"], "size": asset.get("size"), "digest": digest, "urls": urls[:8]})
    for copy in mine.values():
        out.append(
            {"name": copy.name, "size": copy.size, "digest": f"sha256:{copy.sha256}", "urls": [file_url(copy.name)]}
        )
    return out[:512]


def _node_facts(node: Node, *, has_cuda_runtime: bool) -> NodeFacts:
    return NodeFacts.from_hardware(node.hardware or {}, has_cuda_runtime=has_cuda_runtime, system="linux")


def _held_serves(node: Node, assets: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the archives the control plane holds alone give this node a build it may run (with
    or without the CUDA runtime on the host, which only the node knows)."""
    held = [a for a in parse_assets({"assets": list(assets)}) if file_url(a.name) in a.urls]
    return any(choose_builds(_node_facts(node, has_cuda_runtime=runtime), held)[0] for runtime in (False, True))


def _fix(version: str) -> str:
    return _(
        "on the control plane, run “llmgw engine-files fetch %(version)s” where GitHub can be reached, "
        "or copy this node's archive of release %(version)s in with “llmgw engine-files add FILE”"
    ) % {"version": version}


@dataclass(frozen=True)
class EngineTables:
    """The rules, releases and held archives, read once for a push to many nodes."""

    rules: list[EngineChoice]
    releases: dict[tuple[str, str], EngineRelease]
    held: dict[str, HeldFile] = field(default_factory=dict)

    @classmethod
    def read(cls) -> EngineTables:
        return cls(
            list(EngineChoice.objects.all()),
            {(r.engine, r.version): r for r in EngineRelease.objects.all()},
            held_files(),
        )


def desired_engines(node: Node, tables: EngineTables | None = None) -> list[dict[str, Any]]:
    """The engines this node should have, with their release's assets (or why there are none yet)."""
    out = []
    tables = tables or EngineTables.read()
    for engine, (version, _why) in sorted(choices_for(node, tables.rules).items()):
        if version == NONE:
            continue
        if engine in PYTHON_ENGINES:
            out.append(_python_engine(node, engine, version, tables))
        else:
            out.append(_archive_engine(node, engine, version, tables))
    return out


def _archive_engine(node: Node, engine: str, version: str, tables: EngineTables, *, ask: bool = True) -> dict[str, Any]:
    """An engine installed from release archives: what the control plane offers of it (the held
    archives whatever GitHub says), why it offers nothing, and the fix where nothing it holds suits
    the node."""
    entry: dict[str, Any] = {"engine": engine, "version": version}
    if engine in SOURCE_BUILDS:
        entry["source"] = dict(SOURCE_BUILDS[engine])
        if settings.ENGINE_SOURCE_AFTER_REFUSAL:
            entry["source"]["after_refusal"] = True
    release = tables.releases.get((engine, version))
    read = release is not None and release.fetched_at is not None
    assets = offered_assets(engine, version, release if read else None, tables.held)
    if read or assets:
        entry["assets"] = assets
    if read:
        pass  # the listing says it all
    elif release is not None and release.error:
        entry["note"] = _("the control plane cannot read release %(version)s: %(error)s") % {
            "version": version,
            "error": release.error,
        }
        # Only when the API could not be reached at all may a CPU node compile instead (a
        # release that does not exist is an operator's mistake, not a reason to build for minutes).
        entry["unreachable"] = release.unreachable
    else:
        entry["note"] = _("the control plane has not read release %(version)s yet") % {"version": version}
        if ask:
            _ask_for_releases()
    if engine in HELD_PREFIXES and not _held_serves(node, assets):
        entry["fix"] = _fix(version)
    return entry


def offer_problem(node: Node, engine: str, version: str, tables: EngineTables | None = None) -> str | None:
    """The control plane's own word for the node page where it has neither a release listing (it
    tried and could not read one) nor a held archive that suits the node, with the command that
    fixes it; None where it can offer something (or has not tried to read the release yet)."""
    tables = tables or EngineTables.read()
    release = tables.releases.get((engine, version))
    if engine not in HELD_PREFIXES or release is None or release.fetched_at is not None or not release.error:
        return None
    if _held_serves(node, offered_assets(engine, version, None, tables.held)):
        return None
    return _(
        "The control plane cannot read release %(version)s (%(error)s) and holds no archive of it that "
        "suits this node: %(fix)s."
    ) % {"version": version, "error": release.error, "fix": _fix(version)}


def _python_engine(node: Node, engine: str, version: str, tables: EngineTables) -> dict[str, Any]:
    """vLLM or SGLang for this node: the release's wheels and uv's archives once both were read
    (or tried: the package index's build needs no listing), and how to build the environment."""
    floor = min_compute(engine, version) or (7, 5)
    entry: dict[str, Any] = {
        "engine": engine,
        "version": version,
        "build": node.engine_build if node.engine_build != Node.EngineBuild.NONE else "auto",
        "index_variant": settings.PYTHON_ENGINE_INDEX_VARIANT,
        "torch_index": settings.TORCH_INDEX_URL,
        "min_compute": _cc(floor),
        "min_free_bytes": int(settings.PYTHON_ENGINE_FREE_GB * 10**9),
    }
    oldest = oldest_gpu(node)
    if oldest is not None and oldest < floor:
        entry["unsupported"] = _(
            "%(engine)s %(version)s needs compute capability %(floor)s or newer and no version llmgw knows is "
            "built for this node's %(have)s"
        ) % {"engine": engine, "version": version, "floor": _cc(floor), "have": _cc(oldest)}
    releases = tables.releases
    release, uv = releases.get((engine, version)), releases.get(("uv", UV_VERSION))
    tried = [r for r in (release, uv) if r is not None and (r.fetched_at is not None or r.error)]
    if len(tried) < 2:
        entry["note"] = _("the control plane has not read release %(version)s yet") % {"version": version}
        _ask_for_releases()
        return entry
    assert release is not None and uv is not None
    entry["assets"] = offered_assets(engine, version, release, tables.held) if release.fetched_at is not None else []
    uv_assets = offered_assets("uv", UV_VERSION, uv, tables.held) if uv.fetched_at is not None else []
    entry["uv"] = {"version": UV_VERSION, "assets": uv_assets}
    errors = [f"{r.engine} {r.version}: {r.error}" for r in (release, uv) if r.fetched_at is None and r.error]
    if errors:
        entry["note"] = _("the control plane cannot read %(what)s; the package index's build is used") % {
            "what": "; ".join(errors)
        }
    return entry


def _ask_for_releases() -> None:
    """Have the worker read the releases nodes wait for now (at most once a minute), rather than
    at beat's next minute: a node that joins is told its engine's assets within seconds."""
    from django.core.cache import cache

    from apps.cluster import history

    # The process's one Redis client where there is Redis: this runs for every agent that joins, in
    # its connection's own context, where Django's cache would open a connection of its own for each.
    client = history.client()
    if client is not None:
        if not client.set(f"{settings.REDIS_PREFIX}:engines:fetch-asked", 1, nx=True, ex=60):
            return
    elif not cache.add("llmgw:engines:fetch-asked", 1, 60):
        return

    def kick() -> None:
        try:
            from apps.cluster.tasks import fetch_engine_releases

            fetch_engine_releases.delay()
        except Exception:  # the broker being away must not fail the desired state
            log.warning("could not ask the worker to read engine releases; beat will", exc_info=True)

    transaction.on_commit(kick)


# --------------------------------------------------------------------------- releases


def _opener() -> urllib.request.OpenerDirector:
    context = ssl.create_default_context()
    bundle = settings.PROVIDER_CA_BUNDLE
    if bundle:
        if os.path.isdir(bundle):
            context.load_verify_locations(capath=bundle)
        else:
            context.load_verify_locations(cafile=bundle)
    return outbound.opener(context)


def fetch_release(engine: str, version: str) -> EngineRelease:
    """Read one release's assets from the releases API and keep them (or the error)."""
    repo = ENGINE_REPOS.get(engine) or TOOL_REPOS[engine]
    tag = TAG_FORMAT.get(engine, "{version}").format(version=version)
    url = f"{settings.ENGINE_RELEASES_API}/repos/{repo}/releases/tags/{urllib.parse.quote(tag, safe='')}"
    headers = {"Accept": "application/vnd.github+json", "User-Agent": "llmgw", "X-GitHub-Api-Version": "2022-11-28"}
    if settings.ENGINE_RELEASES_TOKEN:
        headers["Authorization"] = f"Bearer {settings.ENGINE_RELEASES_TOKEN}"
    release, _created = EngineRelease.objects.get_or_create(engine=engine, version=version)
    before = _read_state(release)
    release.tried_at = timezone.now()
    try:
        with _opener().open(urllib.request.Request(url, headers=headers), timeout=FETCH_TIMEOUT_S) as answer:
            body = answer.read(MAX_LISTING_BYTES + 1)
        if len(body) > MAX_LISTING_BYTES:
            raise ValueError(f"the answer is larger than {size_text(MAX_LISTING_BYTES)}")
        data = json.loads(body)
        assets = _clean_assets(data)
    except urllib.error.HTTPError as exc:
        release.error = f"HTTP {exc.code} {exc.reason} from {url}"[:1000]
        release.unreachable = False
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        release.error = f"cannot reach {url}: {reason}"[:1000]
        release.unreachable = True
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested past the reader's depth
        release.error = f"{url} did not answer a release: {exc}"[:1000]
        release.unreachable = False
    else:
        release.assets = assets
        release.fetched_at = timezone.now()
        release.error = ""
        release.unreachable = False
    release.save()
    _say_change(release, before)
    return release


def _read_state(release: EngineRelease) -> str:
    """What the release's last read came to: "" (read, or never tried), "unreachable" (whatever the
    network said this time), or the answer's error."""
    return "unreachable" if release.unreachable else release.error


def _say_change(release: EngineRelease, before: str) -> None:
    """Log a read that failed once, not at every retry: a line when the state changes (read ->
    failed, unreachable -> refused, failed -> read), nothing while it stays the same."""
    if _read_state(release) == before:
        return
    if release.error:
        log.warning(
            "engine release %s %s: %s (tried again every %d minutes; logged again only when this changes)",
            release.engine,
            release.version,
            release.error,
            RETRY_FAILED_AFTER_S // 60,
        )
    else:
        log.info("engine release %s %s: read (it had failed: %s)", release.engine, release.version, before)


# What the agent's schema takes of an asset (agent.protocol's DESIRED_ENGINE): a listing that
# breaks it would have every node refuse its whole desired state.
_ASSET_NAME = protocol.string(300)
_ASSET_SIZE = protocol.within(0, protocol.INT64 - 1, whole=True)
_ASSET_URL = protocol.string(4096)


def _fits(check: protocol.Check, value: Any) -> bool:
    try:
        check(value, "asset")
    except protocol.ProtocolError:
        return False
    return "\x00" not in value if isinstance(value, str) else True


def _clean_assets(data: Any) -> list[dict[str, Any]]:
    """The assets of a releases API answer as nodes are sent them: an asset whose name is not a
    plain file name is left out; a size or address the agent's schema would refuse is unknown
    (None), so one forged field never spoils a node's desired state."""
    if not isinstance(data, dict) or not isinstance(data.get("assets"), list):
        raise ValueError("no assets list")
    assets = []
    for item in data["assets"][:512]:
        name = item.get("name") if isinstance(item, dict) else None
        if not _fits(_ASSET_NAME, name) or not name or "/" in name or "\\" in name or name in (".", ".."):
            continue
        digest, size, url = item.get("digest"), item.get("size"), item.get("browser_download_url")
        assets.append(
            {
                "name": name,
                "size": size if _fits(_ASSET_SIZE, size) else None,
                "digest": digest if isinstance(digest, str) and re.match(r"^sha256:[0-9a-fA-F]{64}$", digest) else None,
                "browser_download_url": url
                if _fits(_ASSET_URL, url) and url.startswith(("https://", "http://"))
                else None,
            }
        )
    return assets


def fetch_wanted_releases() -> list[EngineRelease]:
    """Read the releases some node wants and nobody has read yet (failed ones again after 10 min);
    then tell the nodes, whose desired state now carries the assets (or why there are none)."""
    now = timezone.now()
    known = {(r.engine, r.version): r for r in EngineRelease.objects.all()}
    fetched = []
    for engine, version in sorted(wanted_versions()):
        release = known.get((engine, version))
        if release is not None and release.fetched_at is not None:
            continue
        if release is not None and release.tried_at and (now - release.tried_at).total_seconds() < RETRY_FAILED_AFTER_S:
            continue
        fetched.append(fetch_release(engine, version))
    if fetched:  # read, or failed with a reason the nodes waiting for it should show
        nodes_changed(None)
    return fetched


def nodes_changed(node_ids: set[int] | None) -> None:
    """Bump the desired version of the nodes (every node when None) and push their desired state."""
    from django.db.models import F

    from apps.cluster.reconciler import push_desired_state

    nodes = Node.objects.filter(revoked_at__isnull=True)
    if node_ids is not None:
        nodes = nodes.filter(pk__in=node_ids)
    nodes.update(desired_version=F("desired_version") + 1)
    try:
        push_desired_state(node_ids)
    except Exception:
        log.warning("could not push the engines to the nodes; their next heartbeat will fetch them", exc_info=True)


# --------------------------------------------------------------------------- held files


_HELD_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,299}$")


def store_file(name: str, chunks: Iterable[bytes]) -> tuple[Path, str, int]:
    """Keep an engine archive the control plane will serve (with a `.sha256` beside it), and tell
    the nodes: it is offered to them whatever GitHub says."""
    final, digest, size = _store(name, chunks)
    nodes_changed(None)
    return final, digest, size


def _store(
    name: str, chunks: Iterable[bytes], *, sha256: str | None = None, size: int | None = None
) -> tuple[Path, str, int]:
    """Write an archive to ENGINE_FILES_DIR through a temporary file, renamed into place (with its
    `.sha256`) only when it is whole: `sha256` and `size`, when given, must match, and no more than
    `size` (else MAX_HELD_BYTES) is read. EngineConfigError says why a file was not kept."""
    if not _HELD_NAME_RE.match(name) or name.endswith(".sha256"):
        raise EngineConfigError(
            _("file name: letters, digits, dots, dashes and pluses only, got %(name)r") % {"name": name}
        )
    folder = Path(settings.ENGINE_FILES_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.{os.getpid()}.part"
    limit = size if size is not None else MAX_HELD_BYTES
    digest = hashlib.sha256()
    written = 0
    try:
        with open(tmp, "wb") as handle:
            for chunk in chunks:
                written += len(chunk)
                if written > limit:
                    raise EngineConfigError(
                        _("%(name)s: more than the %(limit)s expected") % {"name": name, "limit": size_text(limit)}
                    )
                handle.write(chunk)
                digest.update(chunk)
        if size is not None and written != size:
            raise EngineConfigError(
                _("%(name)s: got %(got)s of %(size)s bytes")
                % {"name": name, "got": f"{written:,}", "size": f"{size:,}"}
            )
        if sha256 is not None and digest.hexdigest() != sha256:
            raise EngineConfigError(
                _("%(name)s: its sha256 is %(got)s, the release lists %(want)s")
                % {"name": name, "got": digest.hexdigest()[:12] + "…", "want": sha256[:12] + "…"}
            )
        final = folder / name
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    final.with_name(name + ".sha256").write_text(f"{digest.hexdigest()}  {name}\n")
    return final, digest.hexdigest(), written


@dataclass(frozen=True)
class FleetFile:
    """One archive `fetch_held` was asked for: fetched, already held, or failed (with why)."""

    name: str
    state: str  # "fetched", "held", "failed"
    detail: str  # its size and digest, or why it was not kept
    nodes: tuple[str, ...]  # the nodes whose build it is


@dataclass(frozen=True)
class FleetFetch:
    """What `llmgw engine-files fetch` did: each archive, and the nodes it found no build for."""

    files: list[FleetFile]
    without: list[tuple[str, str]]  # (node, why it needs none of this release's archives)


def fetch_held(engine: str, version: str, *, names: Iterable[str] = ()) -> FleetFetch:
    """Fetch once, onto the control plane, the archives of a release its fleet needs: for each
    node that installs the engine, the build it would install (its OS, architecture and backend,
    from its hardware report) and the CUDA runtime archive that goes with it, plus `names`. The
    listing is read again through the guarded opener (the one kept is used when GitHub cannot be
    reached now); each archive is checked against its listed size and sha256 before it is kept.
    EngineConfigError when there is no listing, or nothing to fetch."""
    check_engine(engine)
    check_version(version, "version")
    if engine not in HELD_PREFIXES:
        raise EngineConfigError(
            _("%(engine)s is installed from the package index, not from archives the control plane holds")
            % {"engine": engine}
        )
    release = fetch_release(engine, version)
    if release.fetched_at is None:
        raise EngineConfigError(
            _("cannot read release %(version)s: %(error)s") % {"version": version, "error": release.error}
        )
    listed = {a["name"]: a for a in release.assets or [] if isinstance(a, dict) and isinstance(a.get("name"), str)}
    needed, without = _needed_by_fleet(engine, version, list(listed.values()))
    for name in names:
        if name not in listed:
            raise EngineConfigError(_("release %(version)s lists no %(name)s") % {"version": version, "name": name})
        needed.setdefault(name, [])
    if not needed:
        raise EngineConfigError(
            _("no node needs an archive of release %(version)s: name the archives with --asset") % {"version": version}
        )
    held = held_files()
    files = [_fetch_one(listed[name], tuple(nodes), held.get(name)) for name, nodes in sorted(needed.items())]
    if any(f.state == "fetched" for f in files):
        nodes_changed(None)
    return FleetFetch(files, without)


def _needed_by_fleet(
    engine: str, version: str, listing: list[dict[str, Any]]
) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """Archive name -> the nodes whose best build it is (with its runtime archive), and the nodes
    that need none: the engine kept off, run as agent.yaml names it, or no build suits them."""
    assets = parse_assets({"assets": listing})
    needed: dict[str, list[str]] = {}
    without: list[tuple[str, str]] = []
    rules = list(EngineChoice.objects.all())
    for node in Node.objects.filter(revoked_at__isnull=True).prefetch_related("gpus").order_by("name"):
        hardware = node.hardware or {}
        if choices_for(node, rules).get(engine, (NONE, ""))[0] == NONE:
            without.append((node.name, _("the engine is kept off this node")))
        elif (hardware.get("engine_sources") or {}).get(engine) == "configured":
            without.append((node.name, _("its agent.yaml names the engine's binary")))
        elif not hardware.get("arch"):
            without.append((node.name, _("it has not reported its hardware yet")))
        else:
            builds, skipped = choose_builds(_node_facts(node, has_cuda_runtime=False), assets)
            if not builds:
                without.append((node.name, "; ".join(skipped) or _("no build of this release suits it")))
                continue
            for asset in (builds[0].asset, builds[0].runtime):
                if asset is not None:
                    needed.setdefault(asset.name, []).append(node.name)
    return needed, without


def _fetch_one(asset: dict[str, Any], nodes: tuple[str, ...], held: HeldFile | None) -> FleetFile:
    """Download one listed archive into ENGINE_FILES_DIR, unless the same file is held already."""
    name, digest, size = asset["name"], asset.get("digest"), asset.get("size")
    sha256 = digest.split(":", 1)[-1].lower() if isinstance(digest, str) else None
    if sha256 is None:
        return FleetFile(name, "failed", _("the release publishes no sha256 for it: not fetched unchecked"), nodes)
    if held is not None and held.sha256 == sha256:
        return FleetFile(name, "held", f"{size_text(held.size)}, sha256 {sha256}", nodes)
    url = asset.get("browser_download_url")
    if not isinstance(url, str):
        return FleetFile(name, "failed", _("the release gives no address for it"), nodes)
    request = urllib.request.Request(url, headers={"User-Agent": "llmgw", "Accept": "application/octet-stream"})
    try:
        with _opener().open(request, timeout=FETCH_TIMEOUT_S) as answer:
            _path, got, written = _store(
                name,
                iter(lambda: answer.read(1 << 20), b""),
                sha256=sha256,
                size=size if isinstance(size, int) else None,
            )
    except urllib.error.HTTPError as exc:
        return FleetFile(name, "failed", f"HTTP {exc.code} {exc.reason} from {url}", nodes)
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        return FleetFile(name, "failed", f"cannot reach {url}: {getattr(exc, 'reason', exc)}", nodes)
    except EngineConfigError as exc:
        return FleetFile(name, "failed", str(exc), nodes)
    return FleetFile(name, "fetched", f"{size_text(written)}, sha256 {got}", nodes)
