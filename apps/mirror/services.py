"""What the mirror does: take sources to fetch, run the fetches within a limit, hand out manifests.

- `add_sources(urls)`: each URL names one file on the Hub (a repository page is refused). A GGUF
  file comes alone, a split GGUF part brings its whole set, a safetensors shard or index brings
  the set with its index, config and tokenizer files. The commit the revision points at is read
  once, with each file's size and digest, so what is fetched is what was listed. A fetch that
  would not fit in the mirror's free space (less `MIRROR_RESERVE_GB`) is refused before it starts,
  with the numbers.
- `start_fetches()`: at most `MIRROR_CONCURRENT_FETCHES` files download at once; the rest queue.
- `manifest(version)`: each file with its sha256 and size, given only once nothing of the
  version is downloading and every file is held.
"""

from __future__ import annotations

import logging
import shutil
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone
from django.utils.translation import gettext as _

from agent.safepath import NAME_MAX, UnsafePath, check_relative, inside
from apps.accounts import audit
from apps.mirror import hub
from apps.mirror.fetch import FetchFailed, destinations, download, resolve_url
from apps.mirror.hub import HubFile, MirrorError
from apps.mirror.models import MirrorFile, MirrorVersion

__all__ = [
    "NodeState",
    "Space",
    "add_sources",
    "fetch_one",
    "manifest",
    "node_states",
    "remove_version",
    "resume_interrupted",
    "space",
    "start_fetches",
]

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
#: A fetch reports at least every minute while it lives (each read waits at most that long, and a
#: resumed .part reports while it is hashed); one silent for this long has died.
STALE_AFTER_S = 180.0
#: What a file's name may take: the suffix it is written under until verified, and its column.
PART = ".part"
PATH_COLUMN = 1000


@dataclass(frozen=True)
class Space:
    free: int | None
    used: int
    reserve: int


def human(n: int) -> str:
    from agent.install.fetch import human_bytes

    return human_bytes(n)


def space() -> Space:
    folder = Path(settings.MIRROR_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        free: int | None = shutil.disk_usage(folder).free
    except OSError:
        free = None
    used = MirrorFile.objects.filter(state=MirrorFile.State.HELD).aggregate(total=Sum("size"))["total"] or 0
    return Space(free=free, used=used, reserve=int(settings.MIRROR_RESERVE_GB * 10**9))


def _safe_path(path: str) -> str:
    """A file path as the Hub names it, refused unless it can be written under the mirror as named:
    relative, no '.' or '..' part, no backslash or control character, each name short enough to
    take its '.part' suffix, and short enough for its column."""
    try:
        parts = check_relative(path, what="file path")
    except UnsafePath as exc:
        raise MirrorError(
            _("%(path)r is not a file path inside a repository: %(why)s") % {"path": path[:200], "why": exc}
        ) from None
    longest = max(len(part.encode()) for part in parts)
    if longest > NAME_MAX - len(PART) or len(path) > PATH_COLUMN:
        raise MirrorError(
            _(
                "%(path)r is too long to keep: a name of %(longest)d bytes (at most %(names)d) in a path of "
                "%(length)d characters (at most %(paths)d)"
            )
            % {
                "path": path[:200],
                "longest": longest,
                "names": NAME_MAX - len(PART),
                "length": len(path),
                "paths": PATH_COLUMN,
            }
        )
    return path


def _set_for(path: str, files: list[HubFile]) -> tuple[str, str, list[HubFile]]:
    """(kind, name, files) a source path brings: itself, its split set, or its safetensors set."""
    by_path = {f.path: f for f in files}
    if path not in by_path:
        raise MirrorError(_("the repository has no file %(path)s") % {"path": path})
    for group in hub.group_files(files):
        if any(f.path == path for f in group.files):
            if group.kind == "split":
                return MirrorVersion.Kind.GGUF, group.name, group.files
            if group.kind == "safetensors":
                return MirrorVersion.Kind.SAFETENSORS, "safetensors", group.files
            return MirrorVersion.Kind.GGUF, path, group.files
    return MirrorVersion.Kind.FILES, path, [by_path[path]]


def add_sources(urls: Iterable[str], *, actor: Any = None, address: str | None = None) -> list[MirrorVersion]:
    """Queue what each URL names; every URL is checked before any is queued."""
    planned: list[tuple[str, str, str, str, str, list[HubFile]]] = []
    for url in urls:
        repo, revision, path = hub.parse_source(url)
        _safe_path(path)
        commit, files = hub.repo_files(repo, revision)
        kind, name, chosen = _set_for(path, files)
        for file in chosen:
            _safe_path(file.path)
            if not file.sha256 and not file.blob_id:
                raise _unchecked(file.path)
            _where(repo, commit, file.path)
        planned.append((repo, revision, commit, kind, name, chosen))
    if not planned:
        raise MirrorError(_("no source given"))
    held = {
        (f.version.repo, f.version.commit, f.path)
        for f in MirrorFile.objects.filter(state=MirrorFile.State.HELD).select_related("version")
    }
    needed = sum(
        f.size if f.size is not None else unsized_max()
        for repo, _rev, commit, _k, _n, chosen in planned
        for f in chosen
        if (repo, commit, f.path) not in held
    )
    room = space()
    if room.free is not None and needed > room.free - room.reserve:
        raise MirrorError(
            _(
                "not enough space in the mirror (%(folder)s): this needs %(needed)s, %(free)s is free and "
                "%(reserve)s is kept free"
            )
            % {
                "folder": settings.MIRROR_DIR,
                "needed": human(needed),
                "free": human(room.free),
                "reserve": human(room.reserve),
            }
        )
    versions = []
    with transaction.atomic():
        for repo, revision, commit, kind, name, chosen in planned:
            version, created = MirrorVersion.objects.get_or_create(
                repo=repo, commit=commit, name=name, defaults={"revision": revision, "kind": kind, "created_by": actor}
            )
            for file in chosen:
                row, made = MirrorFile.objects.get_or_create(
                    version=version,
                    path=file.path,
                    defaults={"size": file.size, "sha256": file.sha256 or "", "blob_id": file.blob_id or ""},
                )
                if not made and row.state == MirrorFile.State.FAILED:
                    row.state, row.error, row.attempts = MirrorFile.State.QUEUED, "", 0
                    row.save(update_fields=["state", "error", "attempts"])
            if created:
                audit.record(actor, "mirror.add", version, changes={"files": [None, len(chosen)]}, address=address)
            versions.append(version)
        transaction.on_commit(start_fetches)
    return versions


def _unchecked(path: str) -> MirrorError:
    return MirrorError(
        _("the Hub gives neither a sha256 nor a git blob id for %(path)s: it cannot be checked") % {"path": path}
    )


def unsized_max() -> int:
    """The most bytes taken for a file whose size the Hub does not list."""
    return int(settings.MIRROR_UNSIZED_MAX_MB) * 2**20


def _where(repo: str, commit: str, path: str) -> Path:
    """Where a file of a repository at a commit is kept; MirrorError when that is not under the
    mirror's folder."""
    try:
        return inside(Path(settings.MIRROR_DIR).absolute(), repo.replace("/", "--"), commit, path, what="file path")
    except UnsafePath as exc:
        raise MirrorError(
            _("%(path)r cannot be kept in the mirror: %(why)s") % {"path": path[:200], "why": exc}
        ) from None


def start_fetches() -> int:
    """Start queued files while fewer than the limit download; returns how many started."""
    from apps.mirror.tasks import fetch_mirror_file

    started = []
    with transaction.atomic():
        running = MirrorFile.objects.filter(state=MirrorFile.State.DOWNLOADING).count()
        room = settings.MIRROR_CONCURRENT_FETCHES - running
        if room <= 0:
            return 0
        queued = list(
            MirrorFile.objects.select_for_update(skip_locked=True)
            .filter(state=MirrorFile.State.QUEUED)
            .order_by("id")[:room]
        )
        for file in queued:
            file.state = MirrorFile.State.DOWNLOADING
            file.started_at = file.progress_at = timezone.now()
            file.save(update_fields=["state", "started_at", "progress_at"])
            started.append(file.pk)
    for pk in started:
        try:
            fetch_mirror_file.delay(pk)
        except Exception:
            # The broker is away: the file waits in the queue for beat's next start_mirror_fetches.
            log.warning("could not hand mirror file %s to the worker; it stays queued", pk, exc_info=True)
            MirrorFile.objects.filter(pk=pk).update(state=MirrorFile.State.QUEUED, started_at=None, progress_at=None)
    return len(started)


def resume_interrupted(older_than_s: float = STALE_AFTER_S) -> int:
    """Files marked downloading whose fetch has not reported for `older_than_s` (its worker died
    or was killed) queue again: the next fetch resumes their .part with a Range request."""
    from datetime import timedelta

    cutoff = timezone.now() - timedelta(seconds=older_than_s)
    stale = MirrorFile.objects.filter(state=MirrorFile.State.DOWNLOADING).filter(
        Q(progress_at__lt=cutoff) | Q(progress_at__isnull=True, started_at__lt=cutoff) | Q(started_at__isnull=True)
    )
    count = MirrorFile.objects.filter(pk__in=stale.values("pk")).update(
        state=MirrorFile.State.QUEUED, rate=None, started_at=None, progress_at=None
    )
    if count:
        log.warning("mirror: %d fetch(es) stopped reporting for %d s: queued again to resume", count, older_than_s)
    return count


class _TakenOver(Exception):
    """The row this fetch was writing for was queued again, removed or taken by another fetch."""


def fetch_one(pk: int) -> MirrorFile | None:
    """Download one file (the worker's task), then start the next queued ones. Whatever happens,
    the file ends held, queued again (to resume) or failed with the reason; None when the row is
    gone or no longer this task's to fetch."""
    file = MirrorFile.objects.select_related("version").filter(pk=pk).first()
    if file is None or file.state != MirrorFile.State.DOWNLOADING:
        start_fetches()
        return None
    claim = file.started_at

    def progress(done: int, rate: float | None) -> None:
        mine = MirrorFile.objects.filter(pk=pk, state=MirrorFile.State.DOWNLOADING, started_at=claim)
        if not mine.update(bytes_done=done, rate=rate, progress_at=timezone.now()):
            raise _TakenOver()

    try:
        digest = _download(file, progress)
    except _TakenOver:
        log.info("mirror %s: queued again or removed while fetching; this fetch stops", pk)
    except (FetchFailed, MirrorError) as exc:
        _failed(file, str(exc), again=getattr(exc, "resumable", False))
    except Exception as exc:  # noqa: BLE001 - one file's fault must not leave it downloading for ever
        log.exception("mirror %s: the fetch failed", pk)
        _failed(file, _("the fetch failed: %(error)s") % {"error": exc}, again=False)
    else:
        _held(file, digest)
    start_fetches()
    return MirrorFile.objects.select_related("version").filter(pk=pk).first()


def _download(file: MirrorFile, progress: Callable[[int, float | None], None]) -> str:
    version = file.version
    target = _where(version.repo, version.commit, file.path)
    if not file.sha256 and not file.blob_id:
        raise _unchecked(file.path)
    return download(
        resolve_url(version.repo, version.commit, file.path),
        target,
        size=file.size,
        sha256=file.sha256 or None,
        blob_id=file.blob_id or None,
        progress=progress,
        token=settings.HF_TOKEN or None,
        max_bytes=unsized_max(),
        destinations=destinations(),
    )


def _failed(file: MirrorFile, error: str, *, again: bool) -> None:
    """The file queued again to resume (while attempts are left) or failed, with the reason."""
    attempts = file.attempts + 1
    again = again and attempts < MAX_ATTEMPTS
    MirrorFile.objects.filter(pk=file.pk).update(
        state=MirrorFile.State.QUEUED if again else MirrorFile.State.FAILED,
        error=error[:2000],
        attempts=attempts,
        rate=None,
        started_at=None,
        progress_at=None,
    )
    log.warning("mirror %s: %s%s", file, error, " (will resume)" if again else "")


def _held(file: MirrorFile, digest: str) -> None:
    """The file is whole and verified: held, with the digest nodes check it against."""
    done = file.size if file.size is not None else file.local_path.stat().st_size
    MirrorFile.objects.filter(pk=file.pk).update(
        state=MirrorFile.State.HELD,
        bytes_done=done,
        sha256=digest,
        error="",
        rate=None,
        finished_at=timezone.now(),
        progress_at=None,
    )
    if version_state(file.version) == "held" and node_fetches():
        tell_nodes()


def version_state(version: MirrorVersion) -> str:
    states = {f.state for f in version.files.all()}
    if MirrorFile.State.DOWNLOADING in states:
        return "downloading"
    if MirrorFile.State.QUEUED in states:
        return "queued"
    if MirrorFile.State.FAILED in states:
        return "failed"
    return "held" if states == {MirrorFile.State.HELD} else "empty"


def manifest(version: MirrorVersion) -> dict[str, Any]:
    """The version's files with sha256 and size, once every file is held and nothing downloads;
    MirrorError saying what is missing otherwise."""
    files = list(version.files.all())
    waiting = [f for f in files if f.state != MirrorFile.State.HELD]
    if not files or waiting:
        counts: dict[str, int] = {}
        for f in waiting:
            counts[f.state] = counts.get(f.state, 0) + 1
        detail = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        raise MirrorError(
            _("%(held)d of %(total)d files are held (%(detail)s): the manifest is given once all are")
            % {"held": len(files) - len(waiting), "total": len(files), "detail": detail or _("no files")}
        )
    if version.kind == MirrorVersion.Kind.SAFETENSORS:
        from apps.mirror.safetensors import check_set

        try:
            folder = version.folder
        except UnsafePath as exc:
            raise MirrorError(str(exc)) from None
        problems = check_set(folder, {f.path: f.sha256 for f in files if f.path.endswith(".safetensors")})
        if problems:
            raise MirrorError(_("the safetensors set is not whole: %(problems)s") % {"problems": "; ".join(problems)})
    return {
        "repo": version.repo,
        "commit": version.commit,
        "name": version.name,
        "kind": version.kind,
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in files],
    }


@dataclass(frozen=True)
class Summary:
    """What a held GGUF version is, from its header: its shape and the memory it needs."""

    architecture: str
    kind: str  # "model", "adapter", "mmproj"
    adapter_type: str | None
    block_count: int
    context_length: int | None
    estimate: Any  # apps.mirror.estimate.Estimate, None for an adapter or projector
    ctx_size: int
    parallel: int


def summary(version: MirrorVersion, *, ctx_size: int = 4096, parallel: int = 1) -> Summary | None:
    """The header of a held GGUF version (its first file) and, for a model, the memory llama.cpp
    allocates at `ctx_size` tokens over `parallel` slots; None when there is no held GGUF."""
    from apps.mirror.estimate import estimate, shape_of
    from apps.mirror.gguf import FileSource, GGUFError, read_header

    files = [f for f in version.files.all() if f.path.endswith(".gguf")]
    if version.kind != MirrorVersion.Kind.GGUF or not files or any(f.state != MirrorFile.State.HELD for f in files):
        return None
    try:
        shape = shape_of(read_header(FileSource(files[0].local_path)))
    except (GGUFError, OSError, UnsafePath) as exc:
        raise MirrorError(_("%(file)s: %(error)s") % {"file": files[0].path, "error": exc}) from None
    weights = sum(f.size or 0 for f in files)
    ours = (
        estimate(shape, weights, ctx_size=ctx_size, parallel=parallel)
        if shape.kind not in ("adapter", "mmproj")
        else None
    )
    return Summary(
        architecture=shape.architecture,
        kind=shape.kind,
        adapter_type=shape.adapter_type,
        block_count=shape.block_count,
        context_length=shape.context_length,
        estimate=ours,
        ctx_size=ctx_size,
        parallel=parallel,
    )


def node_dir(version: MirrorVersion) -> str:
    """Where a node keeps a version: the same path on every node."""
    return f"{settings.MIRROR_NODE_DIR}/{version.repo.replace('/', '--')}/{version.commit}"


def node_path(version: MirrorVersion, path: str) -> str:
    """A file of a version as a model names it for its source."""
    return f"{node_dir(version)}/{path}"


def node_fetches() -> list[dict[str, Any]]:
    """What the nodes should fetch from the mirror: every held version a declared model's source
    names, with each file's size, sha256 and the control plane's own URL for it."""
    from apps.catalog.models import Model, Profile
    from apps.mirror.lora import lora_paths

    if not MirrorVersion.objects.exists():  # nothing held: no model's source to look through
        return []
    prefix = settings.MIRROR_NODE_DIR + "/"
    sources = set(Model.objects.filter(source__startswith=prefix).values_list("source", flat=True))
    for args in Profile.objects.filter(engine="llama.cpp").values_list("extra_args", flat=True):
        sources |= {path for path, _scale in lora_paths(args or []) if path.startswith(prefix)}
    if not sources:
        return []
    out = []
    for version in MirrorVersion.objects.prefetch_related("files"):
        files = list(version.files.all())
        if not files or any(f.state != MirrorFile.State.HELD for f in files):
            continue
        if node_dir(version) not in sources and not any(node_path(version, f.path) in sources for f in files):
            continue
        out.append(
            {
                "version": version.pk,
                "dir": node_dir(version),
                "files": [
                    {
                        "path": f.path,
                        "size": f.size,
                        "sha256": f.sha256,
                        "url": f"/api/v1/mirror-files/{version.pk}/{urllib.parse.quote(f.path)}",
                    }
                    for f in files
                ],
            }
        )
    return out


@dataclass(frozen=True)
class NodeState:
    """What one node's agent said, with its last heartbeat, of a version it was told to keep."""

    node: str
    state: str  # held, fetching, refused, failed
    message: str


def node_states() -> dict[str, list[NodeState]]:
    """For each directory the nodes keep a version in (node_dir()), what each node's agent said of
    it with its last heartbeat (a node whose heartbeat is over a minute old says nothing), by node."""
    from apps.cluster.choices import NodeStatus
    from apps.cluster.inventory import fetch_states
    from apps.cluster.models import Node

    now = timezone.now()
    out: dict[str, list[NodeState]] = {}
    for node in Node.objects.exclude(status=NodeStatus.REVOKED).only("name", "sample", "sampled_at").order_by("name"):
        for directory, (state, message) in fetch_states(node.fresh_sample(now)).items():
            out.setdefault(directory, []).append(NodeState(node.name, state, message))
    return out


def tell_nodes() -> None:
    """Push the nodes their desired state (which now names what to fetch from the mirror)."""
    from apps.cluster.engines import nodes_changed

    try:
        nodes_changed(None)
    except Exception:
        log.warning("could not tell the nodes what to fetch from the mirror", exc_info=True)


def remove_version(version: MirrorVersion, *, actor: Any = None, address: str | None = None) -> int:
    """Delete a held version's files and rows; refused while any of its files downloads or a
    declared model is served from it."""
    if version.files.filter(state=MirrorFile.State.DOWNLOADING).exists():
        raise MirrorError(_("%(version)s is downloading: wait for it, then remove it") % {"version": str(version)})
    from apps.catalog.models import Model

    users = sorted(Model.objects.filter(source__startswith=node_dir(version) + "/").values_list("name", flat=True))
    if users:
        raise MirrorError(
            _("%(version)s is the source of %(models)s: change or delete those models first")
            % {"version": str(version), "models": ", ".join(users)}
        )
    freed = 0
    paths = []
    for file in version.files.all():
        try:
            kept = (file.local_path, file.part_path)
        except UnsafePath as exc:  # a row from a hostile listing: its files are not the mirror's to delete
            log.warning("mirror: %s is not deleted from disk: %s", file, exc)
            continue
        for path in kept:
            if path.is_file():
                freed += path.stat().st_size
                paths.append(path)

    def delete_files() -> None:  # only once the rows are gone for good
        for path in paths:
            path.unlink(missing_ok=True)

    audit.record(actor, "mirror.remove", version, changes={"files": [version.files.count(), None]}, address=address)
    version.delete()
    transaction.on_commit(delete_files)
    return freed
