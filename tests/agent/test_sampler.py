"""The agent's sampler on fixture hosts: partial results and warnings, never an exception."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from agent import protocol
from agent.config import ConfigError, parse_config
from agent.main import Agent
from agent.sampler import Sampler
from tests.fleet import FIXTURES, HOSTS, build_host, fixtures_available

pytestmark = pytest.mark.skipif(not fixtures_available(), reason=f"no captured fixtures at {FIXTURES}")


def sampler_for(tmp_path: Path, host: str, **config: Any) -> Sampler:
    tools = build_host(HOSTS[host], tmp_path)
    cfg = parse_config(
        {
            "server": "http://127.0.0.1:1",
            "state_dir": str(tmp_path / "state"),
            "root": str(tmp_path),
            "tools": tools,
            **config,
        }
    )
    return Sampler(cfg)


def test_an_h100_host_registers_eight_cards_with_figures(tmp_path: Path) -> None:
    sampler = sampler_for(tmp_path, "h100x8")
    hardware, warnings = asyncio.run(sampler.hardware())
    assert len(hardware["gpus"]) == 8
    assert {g["gpu_class"] for g in hardware["gpus"]} == {"H100-80GB"}
    assert hardware["driver_version"] == "535.161.08"
    assert hardware["os"] == "Ubuntu 22.04.4 LTS"
    sample = asyncio.run(sampler.sample())
    assert len(sample["gpus"]) == 8
    assert all("temperature_gpu_c" in g and "power_draw_w" in g for g in sample["gpus"])
    assert sample["cpu_package_temp_c"] is not None
    # Both messages pass the protocol's schema as the server will check them.
    protocol.parse_message(
        protocol.encode("register", {"agent_version": "t", "hardware": hardware, "sample": sample}), expect="agent"
    )
    protocol.parse_message(protocol.encode("heartbeat", {"sample": sample}), expect="agent")


def test_cpu_utilisation_is_unknown_until_two_samples_differ(tmp_path: Path) -> None:
    sampler = sampler_for(tmp_path, "cpu")
    first = asyncio.run(sampler.sample(force=True))
    assert "cpu_utilization_pct" not in first  # one reading of /proc/stat says nothing about busy
    assert "gpus" not in first  # no nvidia-smi: a CPU node, and no warning about it
    assert first["warnings"] == []


def test_a_host_without_model_directories_reports_no_storage(tmp_path: Path) -> None:
    sample = asyncio.run(sampler_for(tmp_path, "cpu").sample())
    assert "storage" not in sample


def test_storage_is_reported_per_filesystem_with_weights_present(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    (models / "tiny.gguf").write_bytes(b"GGUF" + b"\0" * 100)
    (models / "half.gguf.part").write_bytes(b"GGUF")
    (models / "empty").mkdir()
    missing = tmp_path / "filer-not-mounted"
    sampler = sampler_for(tmp_path, "cpu", model_dirs=[str(models), str(models / "tiny"), str(missing)])
    sample = asyncio.run(sampler.sample())
    assert len(sample["storage"]) == 1  # two directories on one disk are one pool; the missing one is skipped
    pool = sample["storage"][0]
    assert pool["total_bytes"] > 0 and pool["free_bytes"] > 0
    assert pool["weights"] == [str(models / "tiny.gguf")]  # sources, by their path on the node
    assert pool["held"] == [{"path": str(models / "tiny.gguf"), "bytes": 104}]


def test_the_mirrors_files_below_a_model_directory_are_reported_held_by_their_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the mirror writes (<model dir>/mirror/<repo>/<commit>/<file>) is held; a directory whose
    scan stopped at its bound is reported partial, with a warning that says why."""
    from agent.probes import storage
    from tests.ggufgen import make_tiny_gguf

    models = tmp_path / "models"
    source = models / "mirror" / "acme--tiny-GGUF" / ("c" * 40) / "tiny-F32.gguf"
    source.parent.mkdir(parents=True)
    make_tiny_gguf(source)
    sampler = sampler_for(tmp_path, "cpu", model_dirs=[str(models), str(models / "mirror")])
    sample = asyncio.run(sampler.sample(force=True))
    (pool,) = sample["storage"]
    assert pool["weights"] == [str(source)]  # once, though both directories hold it
    assert pool["held"] == [{"path": str(source), "bytes": source.stat().st_size}]
    assert "partial" not in pool and sample["warnings"] == []
    protocol.parse_message(protocol.encode("heartbeat", {"sample": sample}), expect="agent")

    monkeypatch.setattr(storage, "MAX_SCAN_ENTRIES", 2)
    sample = asyncio.run(sampler.sample(force=True))
    (pool,) = sample["storage"]
    assert pool["partial"] == [str(models), str(models / "mirror")]
    assert f"model directory {models}: more than 2 entries; the rest are not looked at" in sample["warnings"]


def test_output_the_parser_has_not_met_is_a_warning_not_a_crash(tmp_path: Path) -> None:
    sampler = sampler_for(tmp_path, "cpu")
    script = tmp_path / "bin" / "nvidia-smi"
    script.write_text("#!/bin/sh\necho '<nvidia_smi_log><gpu id=\"0\"><product_name>X'\n")
    script.chmod(0o755)
    sampler.runner.tools["nvidia-smi"] = str(script)
    hardware, warnings = asyncio.run(sampler.hardware())
    assert hardware["gpus"] == [] or all("index" in g for g in hardware["gpus"])
    assert any("nvidia-smi" in w for w in warnings)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "server: required"),
        ({"server": "ftp://x"}, "server: required"),
        ({"server": "http://x", "heartbeat_interval": 0}, "heartbeat_interval: expected 1 to 300"),
        ({"server": "http://x", "fabrics": [{"rate_gbps": 400}]}, "fabrics[0]: expected a mapping with a name"),
        ({"server": "http://x", "colour": "blue"}, "unknown setting(s): colour"),
    ],
)
def test_agent_yaml_errors_name_the_setting(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    assert message in str(error.value)


def test_the_shipped_agent_example_loads() -> None:
    import yaml

    example = Path(__file__).resolve().parents[2] / "deploy" / "agent.example.yaml"
    config = parse_config(yaml.safe_load(example.read_text()))
    assert config.server.startswith("https://")


class FakeSocket:
    def __init__(self, incoming: list[str]) -> None:
        self.incoming = incoming
        self.sent: list[str] = []

    def __aiter__(self) -> FakeSocket:
        return self

    async def __anext__(self) -> str:
        if not self.incoming:
            raise StopAsyncIteration
        return self.incoming.pop(0)

    async def send(self, text: str) -> None:
        self.sent.append(text)


def test_a_bad_message_from_the_server_is_answered_and_the_agent_goes_on(tmp_path: Path) -> None:
    sampler = sampler_for(tmp_path, "cpu")
    agent = Agent(sampler.config, sampler)
    ws = FakeSocket(
        [
            "{oops",
            json.dumps({"v": 1, "type": "warp"}),
            protocol.encode("registered", {"node": "cpu1", "heartbeat_interval": 3}),
        ]
    )
    asyncio.run(agent.receive(ws))
    errors = [json.loads(text) for text in ws.sent]
    assert [e["code"] for e in errors] == ["malformed", "unknown_type"]
    assert agent.registered.is_set() and agent.node_name == "cpu1" and agent.interval == 3


def test_the_heartbeat_carries_what_the_agent_made_of_each_mirror_version_it_was_told_to_keep(
    tmp_path: Path,
) -> None:
    """A version the control plane sends into a directory outside model_dirs is refused, and the
    refusal goes to the control plane with the next heartbeat, valid by the protocol's schema."""
    sampler = sampler_for(tmp_path, "cpu", model_dirs=[str(tmp_path / "models")], heartbeat_interval=1)
    agent = Agent(sampler.config, sampler)
    folder = "/var/lib/llmgw/models/mirror/acme--tiny-GGUF/" + "c" * 40
    wanted = {"version": 3, "dir": folder, "files": [{"path": "tiny.gguf", "url": "/api/v1/mirror-files/3/tiny.gguf"}]}

    async def run() -> list[str]:
        ws = FakeSocket([])
        agent.registered.set()
        await agent.mirror.converge([wanted])
        assert agent.mirror.running is not None
        await agent.mirror.running
        beating = asyncio.create_task(agent.heartbeats(ws))
        while not ws.sent:
            await asyncio.sleep(0.05)
        beating.cancel()
        return ws.sent

    sent = asyncio.run(run())
    message = protocol.parse_message(sent[0], expect="agent")
    (entry,) = message.body["sample"]["mirror"]
    assert entry["version"] == 3 and entry["dir"] == folder and entry["state"] == "refused"
    assert entry["message"].startswith(f"{folder} is not inside this node's model_dirs ({tmp_path / 'models'})")


def test_agent_yaml_takes_the_address_engines_are_reached_at() -> None:
    config = parse_config({"server": "http://x", "advertise_address": "10.0.3.12"})
    assert config.advertise_address == "10.0.3.12"


def test_xids_are_counted_per_card_and_a_card_without_any_reads_none_not_unknown(tmp_path: Path) -> None:
    sampler = sampler_for(tmp_path, "h100x8")
    sample = asyncio.run(sampler.sample())
    xids = [g.get("xids") for g in sample["gpus"]]
    assert all(x is not None for x in xids)  # the kernel log was read: every card has its counts
    assert any(x for x in xids) and any(x == {} for x in xids)  # some cards had XIDs, others none


def test_without_a_readable_kernel_log_the_xids_are_unknown(tmp_path: Path) -> None:
    sampler = sampler_for(tmp_path, "h100x8")
    failing = tmp_path / "bin" / "dmesg"
    failing.write_text("#!/bin/sh\necho 'dmesg: read kernel buffer failed: Operation not permitted' >&2\nexit 1\n")
    sample = asyncio.run(sampler.sample())
    assert all("xids" not in g for g in sample["gpus"])


def test_an_h100_host_reports_its_nvlink_matrix_and_no_imex(tmp_path: Path) -> None:
    # topo -m of the captured HGX: all eight cards on NV18, two NUMA nodes. Its cards' ClusterUUID
    # is zeros (no multi-node domain), so IMEX is not asked.
    sampler = sampler_for(tmp_path, "h100x8")
    hardware, _warnings = asyncio.run(sampler.hardware())
    topology = hardware["gpu_topology"]
    assert [g["index"] for g in topology["gpus"]] == list(range(8))
    assert topology["gpus"][0]["links"] == {str(i): 18 for i in range(1, 8)}
    assert {g["group"] for g in topology["gpus"]} == {"nvl0"}  # one NVSwitch: one group
    assert [g["numa_node"] for g in topology["gpus"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topology["gpus"][4]["cpu_affinity"] == "52-103,156-207"
    sample = asyncio.run(sampler.sample())
    assert "imex" not in sample


def test_a_gb200_tray_reports_its_domain_imex_and_channel(tmp_path: Path) -> None:
    from tests.fleet import GB200_CLUSTER

    sampler = sampler_for(tmp_path, "gb200", gpu_check_interval=1)
    hardware, warnings = asyncio.run(sampler.hardware())
    assert not [w for w in warnings if "topo" in w or "nvidia-smi" in w], warnings
    assert {g["fabric"]["cluster_uuid"] for g in hardware["gpus"]} == {GB200_CLUSTER}
    assert {g["fabric"]["clique_id"] for g in hardware["gpus"]} == {7}
    assert hardware["gpu_topology"]["gpus"][1]["nearest_nics"] == ["mlx5_1"]
    sample = asyncio.run(sampler.sample())
    assert sample["imex"] == {
        "installed": True,
        "channels": [0],
        "state": "READY",
        "configured": True,
        "domain_state": "UP",
        "nodes": [{"index": 0, "address": "127.0.0.1", "state": "READY", "version": None}],
    }
    protocol.parse_message(
        protocol.encode("register", {"agent_version": "t", "hardware": hardware, "sample": sample}), expect="agent"
    )
    # nvidia-imex-ctl gone: IMEX is said to be missing, not skipped.
    sampler.runner.tools["nvidia-imex-ctl"] = str(tmp_path / "no-such-tool")
    sampler._slow_at = 0.0
    again = asyncio.run(sampler.sample(force=True))
    assert again["imex"]["installed"] is False and again["imex"]["channels"] == [0]
    assert "no-such-tool" in again["imex"]["error"]


def test_a_sample_is_taken_at_most_once_per_sample_interval(tmp_path: Path) -> None:
    sampler = sampler_for(tmp_path, "cpu", sample_interval=3600)
    first = asyncio.run(sampler.sample())
    assert asyncio.run(sampler.sample()) is first  # asked again within the interval: the same sample
    assert asyncio.run(sampler.sample(force=True)) is not first
    quick = sampler_for(tmp_path / "quick", "cpu", sample_interval=1)
    one = asyncio.run(quick.sample())
    quick._last_sample_at -= 1.5  # as if a second and a half had passed
    assert asyncio.run(quick.sample()) is not one
    with pytest.raises(ConfigError, match="sample_interval: expected 1 to 86400 seconds, got 0"):
        sampler_for(tmp_path, "cpu", sample_interval=0)


# GPUs in slices, and AMD's -----------------------------------------------------------------------


def _messages(hardware: dict[str, Any], sample: dict[str, Any]) -> None:
    """Both messages pass the protocol's schema as the server will check them."""
    protocol.parse_message(
        protocol.encode("register", {"agent_version": "t", "hardware": hardware, "sample": sample}), expect="agent"
    )
    protocol.parse_message(protocol.encode("heartbeat", {"sample": sample}), expect="agent")


def test_an_h100_in_mig_mode_registers_the_card_split_and_each_slice_with_its_uuid(tmp_path: Path) -> None:
    sampler = sampler_for(tmp_path, "h100-mig")
    hardware, warnings = asyncio.run(sampler.hardware())
    assert not [w for w in warnings if "MIG" in w or "GPU" in w], warnings
    card, *slices = hardware["gpus"]
    assert (card["index"], card["split"], card["gpu_class"], card["vendor"]) == (0, True, "H100-80GB", "nvidia")
    assert [(s["index"], s["parent"], s["profile"]) for s in slices] == [
        (1000, 0, "3g.40gb"),
        (1001, 0, "2g.20gb"),
        (1002, 0, "1g.10gb"),
        (1003, 0, "1g.10gb"),
    ]
    assert slices[2]["device_id"] == "MIG-00000002-0000-0000-0000-000000000002"
    assert slices[2]["foreign_processes"] == 0
    sample = asyncio.run(sampler.sample(force=True))
    assert [g["index"] for g in sample["gpus"]] == [0, 1000, 1001, 1002, 1003]
    assert sampler.layout_changed == {}
    _messages(hardware, sample)


def test_an_mi300x_board_registers_its_cards_readings_and_xgmi_links(tmp_path: Path) -> None:
    sampler = sampler_for(tmp_path, "mi300x")
    hardware, warnings = asyncio.run(sampler.hardware())
    assert not [w for w in warnings if "amd" in w.lower() or "GPU" in w], warnings
    assert [g["gpu_class"] for g in hardware["gpus"]] == ["MI300X-192GB"] * 8
    first = hardware["gpus"][0]
    assert (first["vendor"], first["device_id"], first["power_limit_w"], first["power_draw_w"]) == (
        "amd",
        "0",
        750,
        171,
    )
    assert (first["temperature_gpu_c"], first["temperature_memory_c"], first["memory_used_mib"]) == (32, 33, 283)
    assert hardware["rocm_version"] == "6.1.0" and hardware["amd_driver_version"] == "6.9.0-rc5+"
    topology = hardware["gpu_topology"]["gpus"]
    assert {g["group"] for g in topology} == {"xgmi0"} and topology[0]["links"] == {str(i): 1 for i in range(1, 8)}
    sample = asyncio.run(sampler.sample(force=True))
    assert [g["power_draw_w"] for g in sample["gpus"]] == [171, 175, 177, 172, 178, 176, 176, 175]
    _messages(hardware, sample)


def test_an_amd_host_with_rocm_smi_alone_takes_its_memory_from_rocminfo(tmp_path: Path) -> None:
    sampler = sampler_for(tmp_path, "mi300x-rocm-smi")
    hardware, warnings = asyncio.run(sampler.hardware())
    assert [g["gpu_class"] for g in hardware["gpus"]] == ["MI300X-192GB"] * 4
    assert hardware["gpus"][3]["power_draw_w"] == 136 and hardware["gpus"][0]["architecture"] == "gfx942"
    _messages(hardware, asyncio.run(sampler.sample(force=True)))


def test_a_partition_mode_change_between_two_heartbeats_marks_the_cards_and_asks_to_register(tmp_path: Path) -> None:
    from tests.fleet import mi300x_static, set_amd_static

    sampler = sampler_for(tmp_path, "mi300x")
    asyncio.run(sampler.hardware())
    # An operator puts card 0 in CPX/NPS4: amd-smi now lists eight partitions for it.
    set_amd_static(tmp_path, mi300x_static(8, "CPX", "NPS4", parts=8, split={0}))
    sample = asyncio.run(sampler.sample(force=True))
    assert list(sampler.layout_changed) == [0]
    marked = [g for g in sample["gpus"] if g.get("fault")]
    assert marked and all(g["index"] == 0 or g.get("parent") == 0 for g in marked)
    assert "layout changed since the node registered" in marked[0]["fault"]
    assert any("GPU 0: its MIG or partition layout changed" in w for w in sample["warnings"])
    hardware, _ = asyncio.run(sampler.hardware())  # registering again takes the new layout
    assert sampler.layout_changed == {} and hardware["gpu_layout_changed"]["cards"]["0"]
    assert [g["gpu_class"] for g in hardware["gpus"] if g.get("parent") == 0] == ["MI300X-192GB-cpx.nps4"] * 8
