"""LoRA adapters from the mirror on a model's llama.cpp profiles.

An adapter is a held GGUF whose header says `general.type = adapter` and `adapter.type = lora`;
llama.cpp loads it only onto a model of the same `general.architecture` (src/llama-adapter.cpp).
Attaching one adds it to every llama.cpp profile of the model as `--lora <path>` (scale 1) or
`--lora-scaled <path>:<scale>` (the current syntax; builds before it took `--lora-scaled FILE
SCALE`, which is why scale 1 uses the plain flag every build has), the path being the adapter's
path on the nodes, which fetch it from the mirror with the model's own source. The profile
change is audited and rolls the replicas as any profile change does. A model, a projector, a
non-LoRA adapter or another architecture is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.utils.translation import gettext as _

from apps.mirror import services
from apps.mirror.hub import MirrorError
from apps.mirror.models import MirrorFile, MirrorVersion

__all__ = [
    "Attached",
    "adapters_panel",
    "attach",
    "attached",
    "detach",
    "held_adapters",
    "held_adapters_panel",
    "lora_paths",
    "model_architecture",
]

LORA_FLAGS = ("--lora", "--lora-scaled")


@dataclass(frozen=True)
class Attached:
    path: str
    scale: float
    version: MirrorVersion | None


def lora_paths(extra_args: list[str]) -> list[tuple[str, float]]:
    """The adapters a profile's extra_args load: (path on the node, scale)."""
    found = []
    args = [str(a) for a in extra_args or []]
    for i, arg in enumerate(args[:-1]):
        if arg == "--lora":
            for path in args[i + 1].split(","):
                found.append((path, 1.0))
        elif arg == "--lora-scaled":
            for item in args[i + 1].split(","):
                path, _sep, scale = item.rpartition(":")
                try:
                    found.append((path, float(scale)))
                except ValueError:
                    continue
    return found


def _without(extra_args: list[str], path: str) -> list[str]:
    out: list[str] = []
    args = [str(a) for a in extra_args or []]
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg in LORA_FLAGS and i + 1 < len(args):
            kept = [item for item in args[i + 1].split(",") if item != path and item.rpartition(":")[0] != path]
            if kept:
                out += [arg, ",".join(kept)]
            skip = True
            continue
        out.append(arg)
    return out


def _version_of(path: str) -> MirrorVersion | None:
    """The version one of whose files is at `path` on the nodes (versions of one commit share a
    directory, so the file decides)."""
    for version in MirrorVersion.objects.prefetch_related("files"):
        if path.startswith(services.node_dir(version) + "/") and any(
            services.node_path(version, f.path) == path for f in version.files.all()
        ):
            return version
    return None


def model_architecture(model: Any) -> str | None:
    """The architecture of a model served from a held GGUF in the mirror; None when its source is not."""
    version = _version_of(str(model.source or ""))
    if version is None:
        return None
    summary = services.summary(version)
    return summary.architecture if summary is not None else None


def held_adapters() -> list[dict[str, Any]]:
    """Every held LoRA adapter, with its architecture."""
    out = []
    for version in MirrorVersion.objects.filter(kind=MirrorVersion.Kind.GGUF).prefetch_related("files"):
        try:
            summary = services.summary(version)
        except MirrorError:
            continue
        if summary is not None and summary.kind == "adapter":
            out.append({"version": version, "architecture": summary.architecture, "type": summary.adapter_type})
    return out


def _llama(model: Any) -> bool:
    return any(p.engine == "llama.cpp" for p in model.profiles.all())


def adapters_panel(model: Any, can_change: bool) -> list[Attached] | None:
    """The model page's adapters (apps.cluster.extensions): those its llama.cpp profiles load;
    None for a model without one."""
    return attached(model) if _llama(model) else None


def held_adapters_panel(model: Any, can_change: bool) -> list[dict[str, Any]] | None:
    """The held adapters the model page offers to attach, to those who may change the model."""
    if not _llama(model):
        return None
    return held_adapters() if can_change else []


def attached(model: Any) -> list[Attached]:
    seen: dict[str, Attached] = {}
    for profile in model.profiles.all():
        if profile.engine != "llama.cpp":
            continue
        for path, scale in lora_paths(profile.extra_args):
            seen.setdefault(path, Attached(path, scale, _version_of(path)))
    return list(seen.values())


def _adapter_file(version: MirrorVersion) -> MirrorFile:
    files = [f for f in version.files.all() if f.path.endswith(".gguf")]
    if not files:
        raise MirrorError(_("%(version)s holds no GGUF file") % {"version": version})
    return files[0]


@transaction.atomic
def attach(
    model: Any, version: MirrorVersion, scale: float = 1.0, *, actor: Any = None, address: str | None = None
) -> str:
    """Load `version` (a held LoRA) on every llama.cpp profile of `model`; returns its node path."""
    from apps.catalog.services import update_profile

    if not 0 < scale <= 10:
        raise MirrorError(_("scale: expected more than 0 and at most 10, got %(scale)s") % {"scale": scale})
    profiles = [p for p in model.profiles.all() if p.engine == "llama.cpp"]
    if not profiles:
        raise MirrorError(
            _("%(model)s has no llama.cpp profile: only llama.cpp loads these adapters") % {"model": model.name}
        )
    summary = services.summary(version)
    if summary is None:
        raise MirrorError(_("%(version)s is not a held GGUF") % {"version": version})
    if summary.kind != "adapter":
        what = _("a projector") if summary.kind == "mmproj" else _("a model")
        raise MirrorError(_("%(version)s is %(what)s, not an adapter") % {"version": version, "what": what})
    if (summary.adapter_type or "") != "lora":
        raise MirrorError(
            _("%(version)s is a %(type)s adapter; llama.cpp loads LoRA adapters")
            % {"version": version, "type": summary.adapter_type or _("untyped")}
        )
    base = model_architecture(model)
    if base is None:
        raise MirrorError(
            _("%(model)s is not served from a held GGUF in the mirror: its architecture cannot be checked")
            % {"model": model.name}
        )
    if base != summary.architecture:
        raise MirrorError(
            _("%(version)s is a LoRA for %(adapter)s; %(model)s is %(base)s")
            % {"version": version, "adapter": summary.architecture, "model": model.name, "base": base}
        )
    path = services.node_path(version, _adapter_file(version).path)
    for profile in profiles:
        args = _without(list(profile.extra_args or []), path)
        args += ["--lora", path] if scale == 1.0 else ["--lora-scaled", f"{path}:{scale:g}"]
        update_profile(profile, actor=actor, address=address, extra_args=args)
    transaction.on_commit(services.tell_nodes)
    return path


@transaction.atomic
def detach(model: Any, path: str, *, actor: Any = None, address: str | None = None) -> int:
    """Stop loading the adapter at `path` on the model's profiles; how many profiles changed."""
    from apps.catalog.services import update_profile

    changed = 0
    for profile in model.profiles.all():
        args = list(profile.extra_args or [])
        kept = _without(args, path)
        if kept != args:
            update_profile(profile, actor=actor, address=address, extra_args=kept)
            changed += 1
    if not changed:
        raise MirrorError(_("%(model)s does not load %(path)s") % {"model": model.name, "path": path})
    return changed
