"""Every parser of agent/probes, and the ibnetdiscover parser, on mutated real output: none raises.

``PARSERS`` lists each parser with what it is run on: its folders of real output (the shared
fixtures and our own captures), generated text, or a few lines written after the tool's own
``printf`` where no capture exists. Each input is then cut short, has bytes flipped, numbers
blown up to 310 and 5,000 digits, 1,500 levels of nesting put around it, NUL characters and
invalid UTF-8 put in it, and the parser must return, whatever it makes of it.

A parser is a public function of an ``agent.probes`` module whose first parameter is ``text``, or
that reads a tree of file contents (a ``Mapping[str, str]``); ``test_every_parser_is_listed``
finds them all, so a parser added later without being listed here fails until it is.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import random
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

import agent.probes
from agent.probes.sysfs import tree_from_grep_r
from tests.agent.fixturefiles import CAPTURED, fixtures_root, read_text
from tests.fabrics.fattree import fat_tree

#: A seed longer than this is cut to it first: the mutations matter, not the size.
SEED_LIMIT = 64 * 1024

SMINFO = "sminfo: sm lid 1 sm guid 0x248a0703005a52b2, activity count 170277 priority 15 state 3 SMINFO_MASTER\n"
SMINFO_FAILED = "ibwarn: [4242] _do_madrpc: recv failed: Connection timed out\nsminfo: iberror: failed: query\n"
SMIR = (
    "SMInfoRecord dump:\n\t\tRID\n\t\tLID...................1\n\t\tSMInfo dump:\n"
    "\t\tGUID..................0x0002c9030010b250\n\t\tSM_Key................0x0000000000000000\n"
    "\t\tActCount..............123456\n\t\tPriority..............15\n\t\tSMState...............3\n"
)
IP_ADDR_JSON = json.dumps(
    [
        {
            "ifindex": 4,
            "ifname": "ibp65s0",
            "addr_info": [{"family": "inet", "local": "10.10.1.7", "prefixlen": 24}],
        },
        {"ifindex": 5, "ifname": "eth0", "addr_info": [{"family": "inet6", "local": "fe80::1", "prefixlen": 64}]},
    ]
)
LOADAVG = "0.52 0.58 0.59 1/467 12345\n"
PID_STAT = (
    "12345 (llama-server) S 1 12345 12345 0 -1 4194560 52031 0 12 0 811 95 0 0 20 0 9 0 4321 "
    "8123456512 212341 18446744073709551615 1 1 0 0 0 0 0 4096 17642 0 0 0 17 3 0 0 0 0 0\n"
)


@dataclass(frozen=True)
class Inputs:
    """What a parser is run on: (folder, glob) pairs of real output, texts, and for a reader of a
    tree of file contents, how a seed becomes that tree."""

    folders: tuple[tuple[str, str], ...] = ()
    texts: tuple[str, ...] = ()
    tree: Callable[[str], Mapping[str, str]] | None = None
    generated: Callable[[], str] | None = None


def _small_fat_tree() -> str:
    return fat_tree(pods=1, sus_per_pod=2, hosts_per_su=3, rails=4, planes=2, hostless_leaves=1).text


PARSERS: dict[str, Inputs] = {
    "agent.probes.amd.parse_amd_smi_json": Inputs(folders=(("amd-smi-json", "*"), ("rocm-smi", "json-*"))),
    "agent.probes.amd.parse_amd_smi_text": Inputs(folders=(("amd-smi-text", "*"), ("amd-smi-json", "*"))),
    "agent.probes.amd.parse_amd_topology": Inputs(folders=(("amd-smi-text", "topology-*"),)),
    "agent.probes.amd.parse_rocm_smi_json": Inputs(folders=(("rocm-smi", "json-*"), ("amd-smi-json", "*"))),
    "agent.probes.amd.parse_rocm_smi_text": Inputs(folders=(("rocm-smi", "*"),)),
    "agent.probes.amd.parse_rocminfo": Inputs(folders=(("rocminfo", "*"),)),
    "agent.probes.hwmon.parse_sensors_json": Inputs(folders=(("hwmon-sensors", "*.json.txt"),)),
    "agent.probes.hwmon.parse_sensors_u": Inputs(folders=(("hwmon-sensors", "sensors-u-*"),)),
    "agent.probes.hwmon.read_hwmon": Inputs(folders=(("hwmon-sensors", "sysfs-*"),), tree=tree_from_grep_r),
    "agent.probes.infiniband.normalise_guid": Inputs(texts=("0x0002c903000a1b2c", "b859:9f03:00ab:8338")),
    "agent.probes.jsontext.read_json": Inputs(
        folders=(("hwmon-sensors", "*.json.txt"), ("mounts-findmnt-df", "findmnt-*")), texts=(IP_ADDR_JSON,)
    ),
    "agent.probes.infiniband.parse_ip_addr_json": Inputs(texts=(IP_ADDR_JSON,)),
    "agent.probes.infiniband.parse_perftest": Inputs(folders=(("perftest", "*"),)),
    "agent.probes.infiniband.parse_saquery_smir": Inputs(texts=(SMIR,)),
    "agent.probes.infiniband.parse_sminfo": Inputs(texts=(SMINFO, SMINFO_FAILED)),
    "agent.probes.infiniband.read_ports": Inputs(folders=(("sysfs-infiniband", "*"),), tree=json.loads),
    "agent.probes.mig.parse_gpu_instances": Inputs(folders=(("nvidia-smi-mig-profiles", "*"),)),
    "agent.probes.mig.parse_mig_list": Inputs(folders=(("nvidia-smi-mig-list", "*"),)),
    "agent.probes.mig.parse_mig_placements": Inputs(folders=(("nvidia-smi-mig-profiles", "*"),)),
    "agent.probes.mig.parse_mig_profiles": Inputs(folders=(("nvidia-smi-mig-profiles", "*"),)),
    "agent.probes.nvidia.parse_nvidia_smi_text": Inputs(folders=(("nvidia-smi-q", "*"), ("nvidia-smi-q-mig", "*"))),
    "agent.probes.nvidia.parse_nvidia_smi_xml": Inputs(folders=(("nvidia-smi-q-xml", "*"),)),
    "agent.probes.nvidia.parse_nvlink_errors": Inputs(folders=(("nvidia-smi-nvlink", "*"),)),
    "agent.probes.nvlink.parse_imex_nodes": Inputs(folders=(("nvidia-imex-ctl", "*"),)),
    "agent.probes.nvlink.parse_imex_state": Inputs(folders=(("nvidia-imex-ctl", "*"),)),
    "agent.probes.nvlink.parse_topo_matrix": Inputs(folders=(("nvidia-smi-topo", "*"),)),
    "agent.probes.procfs.parse_cpuinfo": Inputs(folders=(("proc-cpuinfo", "*"),)),
    "agent.probes.procfs.parse_load_average": Inputs(texts=(LOADAVG,)),
    "agent.probes.procfs.parse_loadavg": Inputs(texts=(LOADAVG,)),
    "agent.probes.procfs.parse_lscpu": Inputs(folders=(("lscpu", "*"),)),
    "agent.probes.procfs.parse_meminfo": Inputs(folders=(("proc-meminfo", "*"),)),
    "agent.probes.procfs.parse_pid_stat": Inputs(texts=(PID_STAT,)),
    "agent.probes.procfs.parse_proc_pid_stat": Inputs(texts=(PID_STAT,)),
    "agent.probes.procfs.parse_proc_stat": Inputs(folders=(("proc-stat", "*"),)),
    "agent.probes.rapl.read_rapl": Inputs(folders=(("rapl-powercap", "*"),), tree=tree_from_grep_r),
    "agent.probes.storage.parse_findmnt_json": Inputs(folders=(("mounts-findmnt-df", "findmnt-*"),)),
    "agent.probes.storage.parse_mountinfo": Inputs(folders=(("mounts-findmnt-df", "proc-*"),)),
    "agent.probes.sysfs.tree_from_grep_r": Inputs(folders=(("hwmon-sensors", "sysfs-*"), ("rapl-powercap", "*"))),
    "agent.probes.xid.parse_xid_lines": Inputs(folders=(("xid", "*"),)),
    "apps.fabrics.topology.parse": Inputs(folders=(("ibnetdiscover", "*"),), generated=_small_fat_tree),
}


def probe_parsers() -> set[str]:
    """Every parser of agent/probes, found by its signature."""
    found: set[str] = set()
    for info in pkgutil.iter_modules(agent.probes.__path__):
        module = importlib.import_module(f"agent.probes.{info.name}")
        for name in getattr(module, "__all__", []):
            function = getattr(module, name)
            if not inspect.isfunction(function) or function.__module__ != module.__name__:
                continue
            params = list(inspect.signature(function).parameters.values())
            if params and (params[0].name == "text" or "Mapping[str, str]" in str(params[0].annotation)):
                found.add(f"{module.__name__}.{name}")
    return found


def test_every_parser_is_listed() -> None:
    found = probe_parsers()
    unlisted = sorted(found - set(PARSERS))
    assert not unlisted, f"parsers with no inputs in PARSERS (add them with their fixture folders): {unlisted}"
    gone = sorted(name for name in PARSERS if name.startswith("agent.") and name not in found)
    assert not gone, f"PARSERS lists functions that are no longer parsers of agent/probes: {gone}"


# Mutations


def _rng(*key: str) -> random.Random:
    return random.Random("/".join(key))


def _flip_bytes(text: str, rng: random.Random) -> str:
    data = bytearray(text.encode("utf-8", "surrogateescape"))
    for _ in range(max(3, len(data) // 200) if data else 0):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return data.decode("utf-8", "surrogateescape")


def _insert(text: str, piece: str, rng: random.Random, times: int = 5) -> str:
    for _ in range(times):
        at = rng.randrange(len(text) + 1)
        text = text[:at] + piece + text[at:]
    return text


_DIGITS = re.compile(r"\d+")
_NUMBERS = re.compile(r"\d+(?:\.\d+)?")
INVALID_UTF8 = b"\xff\xfe\xc3\x28\xed\xa0\x80\xf0\x28\x8c\x28"

MUTATIONS: dict[str, Callable[[str, random.Random], str]] = {
    "cut-10": lambda t, r: t[: len(t) // 10],
    "cut-50": lambda t, r: t[: len(t) // 2],
    "cut-anywhere": lambda t, r: t[: r.randrange(len(t) + 1)],
    "byte-flips": _flip_bytes,
    "310-digit-numbers": lambda t, r: _DIGITS.sub("9" * 310, t, count=200),
    "310-digit-integers": lambda t, r: _NUMBERS.sub("9" * 310, t, count=200),
    "5000-digit-number": lambda t, r: _DIGITS.sub("7" * 5000, t, count=1),
    "negative-huge-numbers": lambda t, r: _DIGITS.sub("-" + "1" * 400, t, count=50),
    "nested-brackets": lambda t, r: "[" * 1500 + t + "]" * 1500,
    "nested-objects": lambda t, r: '{"a": ' * 1500 + t + "}" * 1500,
    "nested-elements": lambda t, r: "<a>" * 1500 + t + "</a>" * 1500,
    "nested-in-the-middle": lambda t, r: _insert(t, "[" * 1500, r, times=1),
    "nul": lambda t, r: _insert(t, "\x00", r) + "\x00",
    "nul-lines": lambda t, r: t.replace("\n", "\x00", 3),
    "invalid-utf8-escaped": lambda t, r: _insert(t, INVALID_UTF8.decode("utf-8", "surrogateescape"), r),
    "invalid-utf8-replaced": lambda t, r: _insert(t, INVALID_UTF8.decode("utf-8", "replace"), r),
    "empty": lambda t, r: "",
}


def seeds(inputs: Inputs) -> Iterator[tuple[str, str]]:
    """(name, text) of every input of a parser, each cut to SEED_LIMIT."""
    for folder, pattern in inputs.folders:
        for directory in (fixtures_root() / folder, CAPTURED / folder):
            if directory.is_dir():
                for path in sorted(directory.glob(pattern)):
                    if path.is_file() and path.name not in ("SOURCES.md", "README.md"):
                        yield f"{folder}/{path.name}", read_text(path)[:SEED_LIMIT]
    for index, text in enumerate(inputs.texts):
        yield f"text-{index}", text
    if inputs.generated is not None:
        yield "generated", inputs.generated()[:SEED_LIMIT]


def resolve(name: str) -> Callable[..., Any]:
    module, _, function = name.rpartition(".")
    return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


def run_mutated(name: str) -> list[str]:
    """Run the parser on every mutation of every seed; what raised, in words."""
    inputs = PARSERS[name]
    parser = resolve(name)
    failures: list[str] = []
    count = 0
    for seed_name, seed in seeds(inputs):
        if inputs.tree is not None:
            tree = dict(inputs.tree(seed))
        for mutation, mutate in MUTATIONS.items():
            rng = _rng(name, seed_name, mutation)
            try:
                if inputs.tree is None:
                    parser(mutate(seed, rng))
                else:
                    parser({key: mutate(value, rng) for key, value in tree.items()})
            except BaseException as exc:  # noqa: BLE001 - any exception is the finding
                failures.append(f"{seed_name} {mutation}: {type(exc).__name__}: {str(exc)[:200]}")
            count += 1
    if count == 0:
        pytest.skip(f"no input for {name}: fixture folders {[f for f, _ in inputs.folders]} not found")
    return failures


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_parser_never_raises_on_mutated_input(name: str) -> None:
    failures = run_mutated(name)
    assert not failures, f"{name} raised on {len(failures)} inputs:\n" + "\n".join(failures[:20])


def test_the_mutations_reach_the_parsers_with_what_they_were_meant_to_put_in() -> None:
    rng = _rng("self-check")
    assert "9" * 310 in MUTATIONS["310-digit-numbers"]("temp1_input: 41.0", rng)
    assert MUTATIONS["nested-brackets"]("{}", rng).startswith("[" * 1500)
    escaped = MUTATIONS["invalid-utf8-escaped"]("abc", rng)
    assert "\udcff" in escaped
    assert "\x00" in MUTATIONS["nul"]("abc", rng)
    flipped = MUTATIONS["byte-flips"]("a" * 1000, rng)
    assert flipped != "a" * 1000 and len(flipped) == 1000


def test_parse_sensors_json_reads_what_it_can_of_huge_and_deep_documents() -> None:
    from agent.probes.hwmon import parse_sensors_json

    huge = parse_sensors_json('{"coretemp-isa-0000": {"Package id 0": {"temp1_input": 1' + "0" * 309 + "}}}")
    assert huge.cpu_package_c is None
    assert huge.warnings[0] == "sensors -j output: 1 numbers too long or not finite were read as unknown"
    deep = parse_sensors_json("[" * 1500 + "]" * 1500)
    assert deep.cpu_package_c is None
    assert deep.warnings == [
        "sensors -j output: the JSON is nested deeper than 64 levels, which no tool writes; not read"
    ]
    # The same bound holds for every JSON an agent probe reads.
    from agent.probes.infiniband import parse_ip_addr_json
    from agent.probes.nvlink import parse_imex_nodes
    from agent.probes.storage import parse_findmnt_json

    assert parse_ip_addr_json("[" * 1500) == {} and parse_findmnt_json('{"a": ' * 1500) == []
    assert parse_imex_nodes("{" + '"a": {' * 1500).nodes == []
    fine = parse_sensors_json('{"coretemp-isa-0000": {"Package id 0": {"temp1_input": 41.0}}}')
    assert fine.cpu_package_c == 41.0


def test_the_devices_a_node_offers_are_built_from_any_mutated_report_without_raising() -> None:
    """agent.devices joins what the parsers made of -q, -L, mig -lgip, amd-smi, rocm-smi and
    rocminfo: every mutation of every capture, joined, must still give a list."""
    from agent.devices import amd_devices, amd_topology, layout_of, nvidia_devices
    from agent.probes import amd, mig, nvidia

    captures = {
        folder: [text for _name, text in seeds(Inputs(folders=((folder, "*"),)))]
        for folder in (
            "nvidia-smi-q-mig",
            "nvidia-smi-mig-list",
            "nvidia-smi-mig-profiles",
            "amd-smi-json",
            "amd-smi-text",
            "rocm-smi",
            "rocminfo",
        )
    }
    if not all(captures.values()):
        pytest.skip("the MIG and AMD fixture folders are not here")
    failures = []
    for mutation, mutate in MUTATIONS.items():
        rng = _rng("devices", mutation)
        try:
            for q in captures["nvidia-smi-q-mig"]:
                for listing in captures["nvidia-smi-mig-list"]:
                    profiles = mig.parse_mig_profiles(mutate(captures["nvidia-smi-mig-profiles"][-1], rng))
                    report = nvidia.parse_nvidia_smi_text(mutate(q, rng))
                    devices, _ = nvidia_devices(report, mig.parse_mig_list(mutate(listing, rng)), profiles)
                    layout_of(devices)
            info = amd.parse_rocminfo(mutate(captures["rocminfo"][-1], rng))
            for text in captures["amd-smi-json"] + captures["amd-smi-text"] + captures["rocm-smi"]:
                changed = mutate(text, rng)
                report = amd.merge_reports(
                    amd.parse_amd_smi_json(changed), amd.parse_amd_smi_text(changed), amd.parse_rocm_smi_text(changed)
                )
                devices, _ = amd_devices(report, info)
                amd_topology(report, devices)
                layout_of(devices)
        except BaseException as exc:  # noqa: BLE001 - any exception is the finding
            failures.append(f"{mutation}: {type(exc).__name__}: {str(exc)[:200]}")
    assert not failures, "\n".join(failures)
