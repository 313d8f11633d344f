"""The mirror's console: Held (live only while something downloads), Explore (search the Hub,
open a repository, fetch a group) and Fetch (a refusal comes back to the form with the reason)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from apps.mirror.models import MirrorFile, MirrorVersion

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(client: Any) -> Iterator[Any]:
    from apps.accounts.choices import StaffRole
    from tests.conftest import make_user

    client.force_login(make_user("ops@example.com", role=StaffRole.OPERATOR))
    yield client


def test_explore_searches_opens_a_repository_and_fetches_a_group(operator: Any, hub: Any, eager: Any) -> None:
    page = operator.get("/mirror/explore", {"q": "tiny"}).content.decode()
    assert 'data-repo="acme/tiny-GGUF"' in page and 'data-repo="acme/tiny"' in page
    page = operator.get("/mirror/explore", {"repo": "acme/tiny-GGUF"}).content.decode()
    assert 'data-group="gguf:Q4_K_M"' in page and 'data-group="split:big"' in page
    commit = hub.repos["acme/tiny-GGUF"].commit
    assert f'value="hf://acme/tiny-GGUF@{commit}/tiny-Q4_K_M.gguf"' in page
    with eager(execute=True):
        answer = operator.post(
            "/mirror/fetch", {"urls": f"hf://acme/tiny-GGUF@{commit}/tiny-Q4_K_M.gguf", "back": "/mirror/explore"}
        )
    assert answer.status_code == 302 and answer["Location"] == "/mirror/"
    assert MirrorFile.objects.get().state == MirrorFile.State.HELD
    page = operator.get("/mirror/").content.decode()
    assert 'data-file="tiny-Q4_K_M.gguf" data-state="held"' in page
    assert 'data-active="false"' in page and 'hx-trigger="every 2s"' not in page  # nothing to follow


def test_held_refreshes_itself_only_while_a_file_downloads(operator: Any, hub: Any) -> None:
    version = MirrorVersion.objects.create(repo="acme/tiny-GGUF", commit="c" * 40, name="x.gguf", kind="gguf")
    MirrorFile.objects.create(
        version=version, path="x.gguf", size=1000, bytes_done=400, rate=100.0, sha256="d" * 64, state="downloading"
    )
    page = operator.get("/mirror/").content.decode()
    assert 'hx-trigger="every 2s"' in page and 'data-active="true"' in page
    assert '<progress class="h-2 w-28" max="100" value="40" data-progress>' in page and "6 s left" in page
    fragment = operator.get("/mirror/", HTTP_HX_REQUEST="true").content.decode()
    assert fragment.lstrip().startswith('<div id="mirror-held"') and "<html" not in fragment  # only the list


def test_a_refused_fetch_returns_to_its_form_with_the_reason(operator: Any, hub: Any) -> None:
    page = f"{hub.url}/acme/tiny-GGUF"
    answer = operator.post("/mirror/fetch", {"urls": page})
    assert answer.status_code == 400
    text = answer.content.decode()
    assert "is a repository page, not a file" in text and f">{page}</textarea>" in text
    back = "/mirror/explore?repo=acme/tiny-GGUF"
    answer = operator.post("/mirror/fetch", {"urls": "hf://acme/tiny-GGUF/nope.gguf", "back": back})
    assert answer.status_code == 302 and answer["Location"] == back
    assert "the repository has no file nope.gguf" in operator.get(back).content.decode()
    assert not MirrorVersion.objects.exists()


def test_a_viewer_reads_the_mirror_but_cannot_fetch(client: Any, hub: Any, tmp_path: Path) -> None:
    from apps.accounts.choices import StaffRole
    from tests.conftest import make_user

    client.force_login(make_user("vic@example.com", role=StaffRole.VIEWER))
    assert client.get("/mirror/").status_code == 200
    assert 'data-tab="fetch"' not in client.get("/mirror/").content.decode()
    assert client.post("/mirror/fetch", {"urls": "hf://acme/tiny-GGUF/tiny-Q4_K_M.gguf"}).status_code == 403


def test_a_held_gguf_shows_its_shape_and_estimate_and_an_adapter_says_so(
    operator: Any, hub: Any, eager: Any, api: Any
) -> None:
    from apps.mirror.estimate import FIXED_OVERHEAD
    from tests.mirror.ggufbytes import header
    from tests.mirror.hubserver import Repo

    model = header(
        {
            "general.architecture": "llama",
            "llama.block_count": 2,
            "llama.embedding_length": 64,
            "llama.attention.head_count": 4,
            "llama.attention.head_count_kv": 2,
            "llama.feed_forward_length": 128,
        }
    )
    adapter = header({"general.architecture": "llama", "general.type": "adapter", "adapter.type": "lora"})
    hub.add(Repo("acme/lora", {"model.gguf": model + bytes(1000), "style-lora.gguf": adapter + bytes(100)}))
    with eager(execute=True):
        first, second = __import__("apps.mirror.services", fromlist=["x"]).add_sources(
            ["hf://acme/lora/model.gguf", "hf://acme/lora/style-lora.gguf"]
        )
    page = operator.get("/mirror/").content.decode()
    assert "llama, 2 layers. At 4096 tokens it needs" in page
    assert "lora adapter for llama" in page
    from apps.accounts.choices import StaffRole
    from tests.conftest import make_user

    api.force_authenticate(make_user("o2@example.com", role=StaffRole.OPERATOR))
    answer = api.get(f"/api/v1/mirror/{first.pk}/estimate", {"ctx_size": 1024, "parallel": 2}).json()
    # 2 layers x 2 KV heads x (16 + 16) x 2 bytes x 512 cells x 2 slots
    assert answer["estimate"]["kv_cache"] == 2 * 2 * 32 * 2 * 512 * 2
    assert answer["estimate"]["weights"] == len(model) + 1000 and answer["estimate"]["overhead"] == FIXED_OVERHEAD
    assert api.get(f"/api/v1/mirror/{second.pk}/estimate").json()["estimate"] is None
    assert api.get(f"/api/v1/mirror/{first.pk}/estimate", {"ctx_size": "x"}).status_code == 400


def test_adapters_made_from_a_held_model_are_listed_from_the_hub(operator: Any, hub: Any) -> None:
    from tests.mirror.hubserver import Repo

    hub.add(Repo("someone/tiny-style-lora", {"lora.gguf": b"GGUF"}, tags=["base_model:adapter:acme/tiny-GGUF"]))
    hub.add(Repo("someone/other-lora", {"lora.gguf": b"GGUF"}, tags=["base_model:adapter:acme/other"]))
    page = operator.get("/mirror/explore", {"adapters_for": "acme/tiny-GGUF"}).content.decode()
    assert 'data-adapters-for="acme/tiny-GGUF"' in page
    assert 'data-repo="someone/tiny-style-lora"' in page and "someone/other-lora" not in page


def test_the_serve_form_places_on_the_freest_gpu_class_refuses_an_idle_cpu_and_declares_a_model(
    operator: Any, hub: Any, eager: Any
) -> None:
    from apps.catalog.models import Model
    from apps.mirror import services
    from tests.builders import make_node

    make_node("gpu1", gpus=2)
    make_node("cpu1", gpus=0)
    with eager(execute=True):
        (version,) = services.add_sources([f"{hub.url}/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"])
    page = operator.get(f"/mirror/{version.pk}/serve").content.decode()
    assert '<option value="H100-80GB" selected>H100-80GB (2 of 2 free)</option>' in page  # the freest chosen
    assert "Runs as llama.cpp, profile h100-80gb, from" in page and "Memory:" in page
    # The CPU while GPUs are free is refused, with the reason, unless ticked.
    answer = operator.post(f"/mirror/{version.pk}/serve", {"name": "tiny", "placement": "cpu", "context": "512"})
    assert answer.status_code == 400 and "2 GPUs are free: on the CPU" in answer.content.decode()
    assert not Model.objects.exists()
    answer = operator.post(
        f"/mirror/{version.pk}/serve", {"name": "tiny", "placement": "cpu", "context": "512", "allow_cpu": "on"}
    )
    assert answer.status_code == 302 and answer["Location"] == "/models/tiny/"
    model = Model.objects.get(name="tiny")
    assert model.source == services.node_path(version, "tiny-Q4_K_M.gguf")
    (profile,) = model.profiles.all()
    assert (profile.name, profile.engine, profile.accelerator, profile.context_size) == ("cpu", "llama.cpp", "cpu", 512)
    assert profile.memory_bytes > 8 * 2**20  # the estimate, rounded up to a MiB
    # The nodes are told to fetch what the new model is served from.
    from apps.cluster.models import Node
    from apps.cluster.reconciler import desired_message

    assert desired_message(Node.objects.get(name="cpu1"), 1)["mirror"][0]["version"] == version.pk


def test_held_says_what_each_node_made_of_a_version_it_was_told_to_keep(operator: Any) -> None:
    from django.utils import timezone

    from apps.cluster import reports
    from apps.mirror import services
    from tests.builders import make_node

    version = MirrorVersion.objects.create(repo="acme/tiny-GGUF", commit="c" * 40, name="x.gguf", kind="gguf")
    MirrorFile.objects.create(version=version, path="x.gguf", size=10, sha256="d" * 64, state="held")
    folder = services.node_dir(version)
    reason = f"{folder} is not inside this node's model_dirs (/srv/models)"
    vm, gpu = make_node("vm", gpus=0), make_node("gpu1", gpus=1)
    now = timezone.now()
    reports.record_heartbeats(
        {
            vm.pk: ({"mirror": [{"version": version.pk, "dir": folder, "state": "refused", "message": reason}]}, now),
            gpu.pk: ({"mirror": [{"version": version.pk, "dir": folder, "state": "held"}]}, now),
        }
    )
    page = operator.get("/mirror/").content.decode()
    assert '<li data-node="gpu1" data-state="held">held on node gpu1</li>' in page
    refused = page[page.index('<li data-node="vm" data-state="refused"') :]
    assert refused[: refused.index("</li>")].endswith(f"node vm refused it: {reason}".replace("'", "&#x27;"))


def _storage(directory: str) -> list[dict[str, Any]]:
    """A node's model directory as its agent reports it, holding nothing yet."""
    pool = {"mount_point": "/", "fstype": "ext4", "shared": False, "total_bytes": 10**12, "free_bytes": 10**11}
    return [{**pool, "directories": [directory], "weights": [], "held": []}]


def test_on_a_two_core_node_without_gpus_the_serve_form_defaults_to_what_fits_and_refuses_what_does_not(
    operator: Any, hub: Any, eager: Any, settings: Any
) -> None:
    """The form's defaults come from the fleet: two cores on the only node, no GPU choice and no
    "use the CPU anyway" where no GPU exists; asking for more than placement would give is refused
    with placement's own numbers, and the defaults declare a model that placement puts there."""
    from apps.catalog.models import Model
    from apps.cluster.models import Node
    from apps.cluster.reconciler import reconcile
    from apps.mirror import services
    from tests.builders import make_node, node_sample

    settings.MIRROR_NODE_DIR = "/data/models/mirror"
    make_node("vm", cpus=2, memory_gb=8, engines=("llama.cpp",))
    Node.objects.filter(name="vm").update(
        sample={**node_sample(cpus=2, memory_gb=8), "storage": _storage("/data/models")}
    )
    with eager(execute=True):
        (version,) = services.add_sources([f"{hub.url}/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"])
    page = operator.get(f"/mirror/{version.pk}/serve").content.decode()
    assert 'name="cpu_cores" type="number" min="1" max="1024" value="2"' in page
    assert 'name="allow_cpu"' not in page and 'name="gpus"' not in page
    assert '<option value="cpu" selected>the CPU</option>' in page
    assert "Free now on vm, the freest node: 2.0 of 2 CPU cores and" in page
    assert 'data-verdict="fits"' in page and "Placement would put it on vm." in page

    answer = operator.post(f"/mirror/{version.pk}/serve", {"name": "tiny", "placement": "cpu", "cpu_cores": "4"})
    assert answer.status_code == 400 and not Model.objects.exists()
    errors = answer.content.decode()
    assert "No node can run it as it stands:" in errors
    assert "node vm has 2 of 2 CPU cores free, needs 4" in errors

    answer = operator.post(f"/mirror/{version.pk}/serve", {"name": "tiny"})  # the form's defaults
    assert answer.status_code == 302
    (profile,) = Model.objects.get(name="tiny").profiles.all()
    assert (profile.accelerator, profile.cpu_cores) == ("cpu", 2)
    reconcile()
    replica = Model.objects.get(name="tiny").replicas.get()
    # Placed once the node holds the file; until then it says it has not got it yet.
    source = services.node_path(version, "tiny-Q4_K_M.gguf")
    assert f"node vm has not fetched {source} from the mirror yet" in [r["message"] for r in replica.rejections]


def test_the_serve_form_refuses_a_node_whose_model_directories_cannot_hold_what_the_mirror_sends(
    operator: Any, hub: Any, eager: Any, settings: Any
) -> None:
    from apps.cluster.models import Node
    from apps.mirror import services
    from tests.builders import make_node, node_sample

    settings.MIRROR_NODE_DIR = "/var/lib/llmgw/models/mirror"
    make_node("vm", cpus=2, memory_gb=8, engines=("llama.cpp",))
    Node.objects.filter(name="vm").update(
        sample={**node_sample(cpus=2, memory_gb=8), "storage": _storage("/srv/models")}
    )
    with eager(execute=True):
        (version,) = services.add_sources([f"{hub.url}/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"])
    page = operator.get(f"/mirror/{version.pk}/serve").content.decode()
    assert 'data-verdict="no-fit"' in page
    source = services.node_path(version, "tiny-Q4_K_M.gguf")
    assert f"node vm would refuse to fetch {source}: it keeps models only in /srv/models" in page
    answer = operator.post(f"/mirror/{version.pk}/serve", {"name": "tiny"})
    assert answer.status_code == 400
