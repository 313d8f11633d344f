"""MIG slices and AMD cards on a fleet: a real agent on the captured H100 in MIG mode (3g.40gb,
2g.20gb and two 1g.10gb) and one on an MI300X board read through amd-smi, `llmgw up`, and models
whose profiles name a slice class and the AMD class, declared with ctl.

The hosts have no GPU to run vLLM on: the engine is the stand-in (standin_vllm.py), started
through a wrapper that writes down the devices it was given, so the test reads what the engine
itself saw: CUDA_VISIBLE_DEVICES=MIG-<uuid> of the slice placed, ROCR_VISIBLE_DEVICES and
HIP_VISIBLE_DEVICES of the AMD cards placed. A shard asking two slices and a profile asking the
split card whole are refused, and explain says why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e import standin_vllm
from tests.e2e.test_fabrics import FAST
from tests.fleet import HOSTS, ControlPlane, fixtures_available

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not fixtures_available(), reason="the shared fixtures are not here"),
]

SLICE = "H100-80GB-1g.10gb"
AMD = "MI300X-192GB"
# The capture's 1g.10gb slices: MIG devices 2 and 3 of GPU 0 (`nvidia-smi -L`).
SLICE_UUIDS = {
    1002: "MIG-00000002-0000-0000-0000-000000000002",
    1003: "MIG-00000003-0000-0000-0000-000000000003",
}

WRAPPER = """import json, os, runpy, sys
args = sys.argv[1:]
if "--port" in args:
    seen = {{k: v for k, v in os.environ.items() if k.endswith("_VISIBLE_DEVICES")}}
    with open({out!r} + "/" + args[args.index("--port") + 1] + ".json", "w") as handle:
        json.dump(seen, handle)
sys.argv = [{standin!r}, *args]
runpy.run_path({standin!r}, run_name="__main__")
"""


def engine(tmp: Path) -> tuple[Path, Path]:
    """The stand-in vLLM behind a wrapper that writes the *_VISIBLE_DEVICES it got, by port."""
    seen = tmp / "engine-env"
    seen.mkdir()
    wrapper = tmp / "engine_wrapper.py"
    wrapper.write_text(WRAPPER.format(out=str(seen), standin=str(Path(standin_vllm.__file__))))
    script = tmp / "vllm"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {wrapper} "$@"\n')
    script.chmod(0o755)
    return script, seen


def model(name: str, accelerator: str, gpus: int, replicas: int = 1) -> dict[str, Any]:
    profile = {"name": "p", "engine": "vllm", "accelerator": accelerator, "gpus_per_shard": gpus}
    return {"name": name, "source": f"/models/{name}", "replicas": replicas, "profiles": [profile]}


def ready(plane: ControlPlane, name: str, count: int) -> dict[str, Any] | None:
    found = plane.api("GET", f"models/{name}")
    return found if found["status"]["ready"] == count else None


def apply(plane: ControlPlane, tmp: Path, models: list[dict[str, Any]]) -> None:
    spec = tmp / "models.yaml"
    spec.write_text(yaml.safe_dump({"models": models}))
    code, _out, err = plane.ctl("model", "apply", "-f", str(spec))
    assert code == 0, err


def rejected(plane: ControlPlane, name: str) -> dict[str, Any] | None:
    replicas = plane.api("GET", f"models/{name}")["replicas"]
    return replicas[0] if replicas and replicas[0]["rejections"] else None


def env_of(seen: Path, shard: dict[str, Any]) -> dict[str, str]:
    return dict(json.loads((seen / f"{shard['port']}.json").read_text()))


def test_slice_and_amd_profiles_are_placed_on_slices_and_amd_cards_and_their_engines_told_which(
    tmp_path: Path,
) -> None:
    script, seen = engine(tmp_path)
    settings = {"engines": {"vllm": str(script)}}
    with ControlPlane(tmp_path, extra_env=FAST, local_agent=False) as plane:
        plane.add_agent("mig", HOSTS["h100-mig"], settings=settings)
        plane.add_agent("amd", HOSTS["mi300x"], settings=settings)
        for name in ("mig", "amd"):
            plane.wait_for(lambda name=name: plane.node(name).get("status") == "ready", what=f"{name} ready")
        classes = {name: {g["gpu_class"] for g in plane.node(name)["gpus"]} for name in ("mig", "amd")}
        assert {SLICE, "H100-80GB-3g.40gb", "H100-80GB-2g.20gb"} <= classes["mig"], classes
        assert classes["amd"] == {AMD}, classes

        # First the refusals, while both 1g.10gb slices are free: one shard cannot take two MIG
        # devices, and the split card is never offered whole.
        refused = [model("two-slices", SLICE, 2), model("whole", "H100-80GB", 1)]
        apply(plane, tmp_path, refused)
        for name, why in (
            ("two-slices", "a CUDA process uses one MIG device, so a shard cannot take 2"),
            ("whole", "1 of them are split into slices, which are placed as their own classes"),
        ):
            replica = plane.wait_for(lambda name=name: rejected(plane, name), timeout=30, what=f"{name} refused")
            assert replica["state"] == "pending" and not replica["shards"], replica
            assert any(why in r["message"] for r in replica["rejections"]), (name, replica["rejections"])
            code, out, _err = plane.ctl("model", "explain", name)
            assert why in out, out

        apply(plane, tmp_path, [*refused, model("small", SLICE, 1, replicas=2), model("rocm", AMD, 2)])
        small = plane.wait_for(lambda: ready(plane, "small", 2), timeout=45, what="small ready on two slices")
        shards = [r["shards"][0] for r in small["replicas"]]
        assert {s["node"] for s in shards} == {"mig"}
        # Each replica on one 1g.10gb slice, never on GPU 0 itself, its engine told the slice's UUID.
        assert sorted(s["gpu_indices"][0] for s in shards) == [1002, 1003]
        for shard in shards:
            (index,) = shard["gpu_indices"]
            assert env_of(seen, shard) == {"CUDA_VISIBLE_DEVICES": SLICE_UUIDS[index]}

        rocm = plane.wait_for(lambda: ready(plane, "rocm", 1), timeout=45, what="rocm ready on two MI300X")
        (shard,) = rocm["replicas"][0]["shards"]
        assert shard["node"] == "amd" and len(shard["gpu_indices"]) == 2
        listed = ",".join(str(i) for i in shard["gpu_indices"])  # amd-smi's index is the ROCm index here
        assert env_of(seen, shard) == {
            "ROCR_VISIBLE_DEVICES": listed,
            "HIP_VISIBLE_DEVICES": "0,1",
            "CUDA_VISIBLE_DEVICES": "0,1",
            "GGML_VK_VISIBLE_DEVICES": listed,
        }
        plane.wait_for(lambda: plane.serves("small") and plane.serves("rocm"), timeout=30, what="both served")
