"""The Hub, through `huggingface_hub` (`HfApi` with the endpoint and token from settings, so any
Hub-compatible server works): search, a repository's files, and what a source URL names.

A repository's files are grouped into what can be fetched (`Group`): each GGUF file on its own (its
quantisation read off the name), each split GGUF set (`…-00001-of-00003.gguf`) whole, the
safetensors set with its index, config and tokenizer files, and projectors (`mmproj`). Adapters
are GGUF files whose header says `general.type = adapter`; the name is only a hint until the
header is read.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.utils.translation import gettext as _

from agent.install.redirects import MAX_REDIRECTS, endpoint
from llmgw.errors import ServiceError

__all__ = ["Group", "HubFile", "HubNotFound", "MirrorError", "group_files", "parse_source", "repo_files", "search"]

#: Files a safetensors set needs besides its shards.
SET_FILES = re.compile(
    r"^(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json|tokenizer\.model|"
    r"special_tokens_map\.json|vocab\.json|merges\.txt|chat_template\.jinja|preprocessor_config\.json|"
    r"model\.safetensors\.index\.json)$"
)
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_QUANT = re.compile(
    r"(?:^|[-_.])((?:IQ\d_[A-Z0-9_]+|Q\d_K(?:_[SML])?|Q\d_\d|Q\d_K_XL|F16|BF16|F32|MXFP4(?:_MOE)?|TQ\d_\d))(?:[-_.]|$)",
    re.IGNORECASE,
)
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_BLOB = re.compile(r"^[0-9a-f]{40}$")
_REVISION = re.compile(r"^[^\x00-\x1f\x7f]{1,200}$")
#: Seconds to wait for the Hub's API to connect or send more of an answer.
API_TIMEOUT_S = 30.0


class MirrorError(ServiceError, ValueError):
    """A source or request the mirror cannot take; str() says why."""

    code = "mirror_refused"


class HubNotFound(MirrorError):
    """The Hub answered that the repository, revision or file does not exist."""

    status = 404
    code = "hub_not_found"


def _not_found(exc: BaseException) -> bool:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    names = {cls.__name__ for cls in type(exc).__mro__}
    return status == 404 or bool(names & {"RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError"})


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int | None
    sha256: str | None  # the LFS digest, for large files
    blob_id: str | None  # the git blob id, for small ones


@dataclass
class Group:
    """Something to fetch: one or more files, with its kind and a name."""

    kind: str  # "gguf", "split", "safetensors", "projector", "adapter"
    name: str
    files: list[HubFile] = field(default_factory=list)

    @property
    def size(self) -> int | None:
        sizes = [f.size for f in self.files]
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)


def api() -> Any:
    from huggingface_hub import HfApi

    _guard_client()
    return HfApi(endpoint=settings.HF_ENDPOINT, token=settings.HF_TOKEN or False)


_guarded = False


def _guard_client() -> None:
    """huggingface_hub's HTTP client, once per process: a timeout on every wait, at most a few
    redirects, and none to this machine's own services (apps/mirror/fetch.py: `destinations`)."""
    global _guarded
    if _guarded:
        return
    import httpx2
    from huggingface_hub.utils import _http, set_client_factory

    def guard(request: Any) -> None:
        refused = redirect_refusal(str(request.url))
        if refused:
            raise httpx2.RequestError(refused, request=request)

    def client() -> Any:
        return httpx2.Client(
            event_hooks={"request": [_http.hf_request_event_hook, guard]},
            follow_redirects=True,
            max_redirects=MAX_REDIRECTS,
            timeout=API_TIMEOUT_S,
        )

    set_client_factory(client)
    _guarded = True


def redirect_refusal(url: str) -> str | None:
    """Why the Hub's API may not be asked `url` (a redirect it gave); None when it may."""
    from apps.mirror.fetch import destinations

    origin = endpoint(settings.HF_ENDPOINT)
    if endpoint(url) == origin:
        return None
    return destinations().url_refusal(url, origin=origin)


def check_repo(repo: str) -> str:
    if not _REPO.match(repo or ""):
        raise MirrorError(_("%(repo)r is not a repository id (expected owner/name)") % {"repo": repo})
    return repo


def search(query: str, *, limit: int = 20) -> list[dict[str, Any]]:
    """Repositories whose name matches `query` (all when empty), at most `limit`."""
    return _list_models({"search": query} if query else {}, limit)


def adapters_for(repo: str, *, limit: int = 50) -> list[dict[str, Any]]:
    """Adapters the Hub lists as made from `repo` (its `base_model:adapter:<repo>` tag)."""
    check_repo(repo)
    return _list_models({"filter": f"base_model:adapter:{repo}"}, limit)


def _list_models(params: dict[str, str], limit: int) -> list[dict[str, Any]]:
    """The Hub's /api/models, page by page up to `limit` entries, one request per page and none
    repeated: huggingface_hub's list_models retries an unreachable Hub five times over some 23
    seconds, logging a warning at each, where a search in a page should fail at once with one
    message (MirrorError). An entry without a string id is left out; a count that is not a whole
    number is unknown (None); tags are the strings among its tags."""
    try:
        entries = _model_pages(params, limit)
    except Exception as exc:  # the Hub's errors come as several exception types
        raise MirrorError(_("the Hub at %(hub)s did not answer: %(error)s") % hub_error(exc)) from None
    found = []
    for entry in entries:
        repo = entry.get("id") or entry.get("modelId")
        if isinstance(repo, str) and repo:
            tags = entry.get("tags")
            found.append(
                {
                    "id": repo,
                    "downloads": _count(entry.get("downloads")),
                    "likes": _count(entry.get("likes")),
                    "tags": [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else [],
                }
            )
    return found[:limit]


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _model_pages(params: dict[str, str], limit: int) -> list[dict[str, Any]]:
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    api()  # the guarded client: timeouts, redirects
    headers = build_hf_headers(token=settings.HF_TOKEN or False)
    url: str | None = f"{settings.HF_ENDPOINT.rstrip('/')}/api/models"
    query: dict[str, Any] | None = {**params, "limit": limit}
    entries: list[dict[str, Any]] = []
    for _page in range(limit):  # a page holds one entry at least, or ends the listing
        assert url is not None
        response = get_session().get(url, params=query, headers=headers)
        hf_raise_for_status(response)
        page = response.json()
        if not isinstance(page, list):
            raise ValueError("the answer is not a list of repositories")
        entries += [entry for entry in page if isinstance(entry, dict)]
        url, query = response.links.get("next", {}).get("url"), None
        if not page or url is None or len(entries) >= limit:
            break
    return entries


def hub_error(exc: BaseException) -> dict[str, str]:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return {"hub": settings.HF_ENDPOINT, "error": text[:300]}


def check_revision(revision: str) -> str:
    if not isinstance(revision, str) or not _REVISION.match(revision):
        raise MirrorError(
            _("%(revision)r is not a revision (a branch, tag or commit of at most 200 characters)")
            % {"revision": str(revision)[:80]}
        )
    return revision


def repo_files(repo: str, revision: str = "main") -> tuple[str, list[HubFile]]:
    """(commit, files) of a repository at a revision, with each file's size and digest. The commit
    is 40 hexadecimal characters or MirrorError; a size or digest the Hub gives in another shape
    is taken as not given."""
    check_repo(repo)
    check_revision(revision)
    try:
        info = api().model_info(repo, revision=revision, files_metadata=True)
    except Exception as exc:
        kind = HubNotFound if _not_found(exc) else MirrorError
        raise kind(
            _("cannot read %(repo)s at %(revision)s from %(hub)s: %(error)s")
            % {"repo": repo, "revision": revision, **hub_error(exc)}
        ) from None
    commit = info.sha if isinstance(info.sha, str) else ""
    if not _COMMIT.match(commit):
        raise MirrorError(
            _("%(hub)s gave %(commit)r as the commit of %(repo)s: a commit id is 40 hexadecimal characters")
            % {"hub": settings.HF_ENDPOINT, "commit": str(info.sha)[:80], "repo": repo}
        )
    return commit, [_listed(sibling) for sibling in info.siblings or []]


def _listed(sibling: Any) -> HubFile:
    """A file as the Hub lists it; a size or digest of the wrong shape is taken as not given, so a
    file is fetched only against a digest that can be checked (and refused with none)."""
    lfs = getattr(sibling, "lfs", None)
    sha256 = None
    if lfs is not None:
        sha256 = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
    size = getattr(sibling, "size", None)
    blob_id = getattr(sibling, "blob_id", None)
    return HubFile(
        path=str(sibling.rfilename),
        size=size if type(size) is int and 0 <= size < 2**63 else None,
        sha256=sha256.lower() if isinstance(sha256, str) and _SHA256.match(sha256.lower()) else None,
        blob_id=blob_id.lower() if isinstance(blob_id, str) and _BLOB.match(blob_id.lower()) else None,
    )


def quantisation(name: str) -> str | None:
    stem = name.rsplit("/", 1)[-1].removesuffix(".gguf")
    match = _QUANT.search(stem)
    return match.group(1).upper() if match else None


def group_files(files: Iterable[HubFile]) -> list[Group]:
    """What a repository offers to fetch, one group per GGUF, split set, safetensors set or projector."""
    files = list(files)
    groups: list[Group] = []
    splits: dict[str, Group] = {}
    for file in files:
        base = file.path.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf"):
            continue
        if match := _SPLIT.match(file.path):
            stem = match.group("stem")
            group = splits.setdefault(stem, Group("split", stem.rsplit("/", 1)[-1]))
            group.files.append(file)
            continue
        lower = base.lower()
        if "mmproj" in lower:
            groups.append(Group("projector", base, [file]))
        elif "lora" in lower or "adapter" in lower:
            groups.append(Group("adapter", base, [file]))
        else:
            groups.append(Group("gguf", quantisation(base) or base, [file]))
    groups += sorted(splits.values(), key=lambda g: g.name)
    shards = [f for f in files if f.path.endswith(".safetensors") and "/" not in f.path]
    if shards:
        extras = [f for f in files if SET_FILES.match(f.path)]
        groups.append(Group("safetensors", "safetensors", sorted(shards + extras, key=lambda f: f.path)))
    return groups


def parse_source(url: str) -> tuple[str, str, str]:
    """(repo, revision, path) a source names: `https://<hub>/<owner>/<name>/resolve/<rev>/<path>`
    (or `/blob/`), or `hf://<owner>/<name>/<path>` (revision main). A repository page is refused."""
    text = (url or "").strip()
    if text.startswith("hf://"):
        parts = text[len("hf://") :].split("/", 2)
        if len(parts) < 3 or not parts[2]:
            raise MirrorError(_("%(url)s names no file: use hf://owner/name/FILE") % {"url": text})
        rev = "main"
        repo_part, path = "/".join(parts[:2]), parts[2]
        if "@" in repo_part:
            repo_part, rev = repo_part.split("@", 1)
        return check_repo(repo_part), rev, path
    split = urllib.parse.urlsplit(text)
    if split.scheme not in ("http", "https") or not split.netloc:
        raise MirrorError(_("%(url)r is not a Hub URL (https://…/owner/name/resolve/main/FILE)") % {"url": text})
    parts = [urllib.parse.unquote(p) for p in split.path.strip("/").split("/")]
    if parts[:1] == ["models"]:
        parts = parts[1:]
    if len(parts) >= 5 and parts[2] in ("resolve", "blob"):
        return check_repo("/".join(parts[:2])), parts[3], "/".join(parts[4:])
    if len(parts) >= 2:
        raise MirrorError(
            _(
                "%(url)s is a repository page, not a file: name a file (…/%(repo)s/resolve/main/FILE.gguf), "
                "or pick a GGUF or safetensors set in the explorer"
            )
            % {"url": text, "repo": "/".join(parts[:2])}
        )
    raise MirrorError(_("%(url)r names no repository") % {"url": text})
