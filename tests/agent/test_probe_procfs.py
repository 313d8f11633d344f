"""/proc/cpuinfo, lscpu, /proc/stat, /proc/meminfo, /proc/loadavg and /proc/<pid>/stat."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fixturefiles import fixture_files, fixture_text, read_text
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.probes.procfs import (
    CpuInfo,
    CpuTimes,
    avx_warning,
    cpu_utilisation,
    parse_cpuinfo,
    parse_loadavg,
    parse_lscpu,
    parse_meminfo,
    parse_pid_stat,
    parse_proc_pid_stat,
    parse_proc_stat,
    process_group_usage,
)
from tests.budget import examples

# --------------------------------------------------------------------------- every fixture


@pytest.mark.parametrize("path", fixture_files("proc-cpuinfo"))
def test_cpuinfo_fixture_parses(path: Path) -> None:
    cpu = parse_cpuinfo(read_text(path))
    assert cpu.model and "  " not in cpu.model
    assert cpu.logical_cpus and cpu.logical_cpus >= 1
    assert cpu.sockets and cpu.sockets >= 1
    assert {"fpu", "sse2"} <= cpu.flags
    assert cpu.is_x86 is True
    assert cpu.has_avx2 is not None and cpu.has_avx512 is not None
    assert (avx_warning(cpu) is None) == cpu.has_avx2


@pytest.mark.parametrize("path", fixture_files("lscpu"))
def test_lscpu_fixture_parses(path: Path) -> None:
    cpu = parse_lscpu(read_text(path))
    assert cpu.model
    assert cpu.logical_cpus and cpu.logical_cpus >= 1
    assert cpu.sockets and cpu.sockets >= 1
    assert cpu.flags
    assert cpu.warnings == []
    if cpu.is_x86:
        assert cpu.has_avx2 is not None
        assert all(len(flag) > 1 for flag in cpu.flags)  # no fragments of wrapped words
    else:
        assert cpu.has_avx2 is None and avx_warning(cpu) is None


@pytest.mark.parametrize("path", fixture_files("proc-stat"))
def test_proc_stat_fixture_parses(path: Path) -> None:
    times = parse_proc_stat(read_text(path))
    assert times.warnings == []
    assert set(times.total) >= {"user", "nice", "system", "idle", "iowait"}
    assert times.per_cpu >= 1
    assert times.busy and times.idle and times.busy > 0 and times.idle > 0


@pytest.mark.parametrize("path", fixture_files("proc-meminfo"))
def test_meminfo_fixture_parses(path: Path) -> None:
    info = parse_meminfo(read_text(path))
    assert info.warnings == []
    assert info.total_bytes and info.total_bytes > 1 << 30
    assert info.free_bytes is not None and 0 < info.free_bytes < info.total_bytes
    if info.available_bytes is not None:
        assert info.free_bytes <= info.available_bytes <= info.total_bytes


# --------------------------------------------------------------------------- /proc/cpuinfo


def test_cpuinfo_i7_8650u_avx2() -> None:
    cpu = parse_cpuinfo(fixture_text("proc-cpuinfo", "procfs-fixture-i7-8650u-8cpu-avx2.txt"))
    assert cpu.model == "Intel(R) Core(TM) i7-8650U CPU @ 1.90GHz"
    assert cpu.vendor == "GenuineIntel"
    assert (cpu.logical_cpus, cpu.sockets, cpu.cores_per_socket, cpu.threads_per_core) == (8, 1, 4, 2)
    assert (cpu.has_avx2, cpu.has_avx512) == (True, False)
    assert cpu.architecture == "x86_64"
    assert cpu.warnings == []
    assert avx_warning(cpu) is None


def test_cpuinfo_i7_2600_has_avx_but_not_avx2() -> None:
    cpu = parse_cpuinfo(fixture_text("proc-cpuinfo", "sysstat-root1-i7-2600-avx.txt"))
    assert "avx" in cpu.flags and "avx2" not in cpu.flags
    assert cpu.has_avx2 is False
    warning = avx_warning(cpu)
    assert warning and "AVX2" in warning and "i7-2600" in warning


def test_cpuinfo_sapphire_rapids_trimmed_space_separated() -> None:
    cpu = parse_cpuinfo(
        fixture_text("proc-cpuinfo", "telegraf-xeon-platinum-8480plus-sapphire-rapids-avx512-amx-4cpu-trimmed.txt")
    )
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu.logical_cpus == 4
    assert cpu.has_avx512 is True
    assert {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"} <= cpu.flags
    assert "ept_x_only" not in cpu.flags  # only on the separate "vmx flags" line
    assert any("trimmed" in w for w in cpu.warnings)  # 4 processors listed, siblings says 112


def test_cpuinfo_xeon_x7550_four_sockets_no_avx() -> None:
    cpu = parse_cpuinfo(fixture_text("proc-cpuinfo", "util-linux-dump-xeon-x7550-4s-64cpu.txt"))
    assert cpu.model == "Intel(R) Xeon(R) CPU X7550 @ 2.00GHz"  # runs of spaces collapsed
    assert (cpu.logical_cpus, cpu.sockets) == (64, 4)
    assert "avx" not in cpu.flags
    assert cpu.has_avx2 is False
    assert avx_warning(cpu) is not None


def test_cpuinfo_tiger_lake_avx512() -> None:
    cpu = parse_cpuinfo(fixture_text("proc-cpuinfo", "util-linux-dump-i7-1165g7-avx512.txt"))
    assert cpu.logical_cpus == 8
    assert cpu.has_avx512 is True
    assert {"avx512f", "avx512_vnni", "avx512vl"} <= cpu.flags


def test_cpuinfo_arm() -> None:
    text = (
        "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"
        "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\n\n"
        "processor\t: 1\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"
        "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\n"
    )
    cpu = parse_cpuinfo(text)
    assert cpu.logical_cpus == 2
    assert cpu.architecture == "aarch64"
    assert "asimd" in cpu.flags
    assert cpu.has_avx2 is None and cpu.has_avx512 is None
    assert avx_warning(cpu) is None
    assert cpu.warnings == []


def test_cpuinfo_x86_without_flags_is_unknown_not_false() -> None:
    cpu = parse_cpuinfo("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Test CPU\n")
    assert cpu.has_avx2 is None
    assert avx_warning(cpu) is None
    assert any("flags" in w for w in cpu.warnings)


@pytest.mark.parametrize("text", ["", "\n\n", "garbage without colons", "processor : x\n"])
def test_cpuinfo_odd_input(text: str) -> None:
    cpu = parse_cpuinfo(text)
    assert cpu.logical_cpus is None
    assert cpu.warnings


# --------------------------------------------------------------------------- lscpu


def test_lscpu_gcp_flags_wrapped_mid_word() -> None:
    cpu = parse_lscpu(fixture_text("lscpu", "gcp-c3-xeon-8481c-kvm-176cpu-flags-wrapped-midword.txt"))
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert (cpu.logical_cpus, cpu.sockets, cpu.cores_per_socket, cpu.threads_per_core) == (176, 2, 44, 2)
    assert cpu.numa_nodes == 4
    assert cpu.architecture == "x86_64"
    # words split across lines are rejoined, words starting a line stay separate
    assert {"lahf_lm", "avx2", "sha_ni", "vaes", "md_clear", "syscall", "pclmulqdq", "serialize"} <= cpu.flags
    assert not {"l", "ahf_lm", "2", "sha_n", "i", "v", "aes_vpclmulqdq", "htsyscall"} & cpu.flags
    assert "aes" in cpu.flags and "avx" in cpu.flags
    assert (cpu.has_avx2, cpu.has_avx512) == (True, True)
    assert len(cpu.flags) == 106


def test_lscpu_epyc_two_sockets_eight_numa_nodes() -> None:
    cpu = parse_lscpu(fixture_text("lscpu", "util-linux-expected-amd-epyc-7451-2s-8numa.txt"))
    assert cpu.model == "AMD EPYC 7451 24-Core Processor"
    assert cpu.vendor == "AuthenticAMD"
    assert cpu.architecture == "x86_64"  # no Architecture line: inferred from the vendor
    assert (cpu.logical_cpus, cpu.sockets, cpu.cores_per_socket, cpu.numa_nodes) == (96, 2, 24, 8)
    assert (cpu.has_avx2, cpu.has_avx512) == (True, False)


def test_lscpu_arm_heterogeneous_cores() -> None:
    cpu = parse_lscpu(fixture_text("lscpu", "util-linux-expected-arm64-hetero-a510-a710-a715-x3.txt"))
    assert cpu.model == "Cortex-A510 / Cortex-A710 / Cortex-A715 / Cortex-X3"
    assert cpu.vendor == "ARM"
    assert cpu.logical_cpus == 8
    assert cpu.sockets == 1
    assert cpu.cores_per_socket == 8  # 3 + 2 + 2 + 1 cores of four types
    assert "asimd" in cpu.flags
    assert cpu.is_x86 is False
    assert cpu.has_avx2 is None and cpu.has_avx512 is None
    assert avx_warning(cpu) is None
    assert cpu.warnings == []


def test_lscpu_vmware_opteron_without_avx2() -> None:
    cpu = parse_lscpu(fixture_text("lscpu", "util-linux-expected-vmware-guest-opteron.txt"))
    assert (cpu.logical_cpus, cpu.sockets, cpu.numa_nodes) == (16, 2, 4)
    assert cpu.has_avx2 is False
    warning = avx_warning(cpu)
    assert warning and "Opteron" in warning


def test_lscpu_xeon_x7550() -> None:
    cpu = parse_lscpu(fixture_text("lscpu", "util-linux-expected-xeon-x7550-4s-64cpu.txt"))
    assert (cpu.logical_cpus, cpu.sockets, cpu.cores_per_socket, cpu.numa_nodes) == (64, 4, 8, 3)
    assert cpu.has_avx2 is False


def test_lscpu_new_indented_layout() -> None:
    text = (
        "Architecture:            x86_64\n"
        "  CPU op-mode(s):        32-bit, 64-bit\n"
        "CPU(s):                  16\n"
        "  On-line CPU(s) list:   0-15\n"
        "Vendor ID:               GenuineIntel\n"
        "  Model name:            Test CPU\n"
        "    Thread(s) per core:  2\n"
        "    Core(s) per socket:  8\n"
        "    Socket(s):           1\n"
        "    Flags:               fpu sse2 avx avx2\n"
        "NUMA:                    \n"
        "  NUMA node(s):          1\n"
    )
    cpu = parse_lscpu(text)
    assert (cpu.logical_cpus, cpu.sockets, cpu.cores_per_socket, cpu.numa_nodes) == (16, 1, 8, 1)
    assert cpu.flags == frozenset({"fpu", "sse2", "avx", "avx2"})
    assert cpu.has_avx2 is True


def test_lscpu_odd_input() -> None:
    assert parse_lscpu("").warnings
    assert parse_lscpu("nothing here\n").warnings


# --------------------------------------------------------------------------- /proc/stat


def test_proc_stat_values() -> None:
    times = parse_proc_stat(fixture_text("proc-stat", "procfs-fixture-8cpu-laptop-huge-intr-line.txt"))
    assert times.total["user"] == 301854
    assert times.total["idle"] == 8979004
    assert times.total["guest_nice"] == 0
    assert times.per_cpu == 8
    assert times.busy == 301854 + 612 + 111922 + 2 + 3944 + 0
    assert times.idle == 8979004 + 3552


def test_proc_stat_offline_cpus_and_utilisation_between_samples() -> None:
    before = parse_proc_stat(fixture_text("proc-stat", "sysstat-root1-i7-2600-8cpu.txt"))
    after = parse_proc_stat(fixture_text("proc-stat", "sysstat-root3-i7-2600-cpu-lines-missing-offline.txt"))
    assert before.per_cpu == 9
    assert after.per_cpu == 7  # cpu6 and cpu8 lines absent (offline)
    busy = after.busy - before.busy  # type: ignore[operator]
    idle = after.idle - before.idle  # type: ignore[operator]
    assert (busy, idle) == (8298, 41475)
    assert cpu_utilisation(before, after) == pytest.approx(100 * 8298 / (8298 + 41475))
    assert cpu_utilisation(after, before) is None  # counters went backwards
    assert cpu_utilisation(before, before) is None  # no time passed


def test_proc_stat_old_kernel_with_fewer_columns_and_garbage() -> None:
    times = parse_proc_stat("cpu  10 0 5 100\ncpu0 10 0 5 100\n")
    assert times.total == {"user": 10, "nice": 0, "system": 5, "idle": 100}
    assert (times.busy, times.idle) == (15, 100)
    empty = parse_proc_stat("intr 1 2 3\n")
    assert empty.busy is None and empty.warnings
    assert cpu_utilisation(empty, times) is None
    assert cpu_utilisation(CpuTimes(), CpuTimes()) is None


# --------------------------------------------------------------------------- meminfo, loadavg


def test_meminfo_without_memavailable_is_not_synthesised() -> None:
    info = parse_meminfo(fixture_text("proc-meminfo", "procfs-fixture-16gb-with-zswap.txt"))
    assert info.total_bytes == 15666184 * 1024
    assert info.free_bytes == 440324 * 1024
    assert info.available_bytes is None


def test_meminfo_desktop() -> None:
    info = parse_meminfo(fixture_text("proc-meminfo", "sysstat-root1-8gb-desktop-memavailable.txt"))
    assert info.total_bytes == 8144960 * 1024
    assert info.available_bytes == 4389516 * 1024
    assert info.free_bytes == 1437740 * 1024


def test_meminfo_odd_input() -> None:
    info = parse_meminfo("nonsense\nMemFree: abc kB\n")
    assert info.total_bytes is None and info.free_bytes is None
    assert info.warnings


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.52 0.58 0.59 1/467 12345\n", (0.52, 0.58, 0.59)),
        ("12.00 8.50 4.25 9/1024 1\n", (12.0, 8.5, 4.25)),
        ("", None),
        ("0.1 0.2\n", None),
        ("a b c d e\n", None),
    ],
)
def test_loadavg(text: str, expected: tuple[float, float, float] | None) -> None:
    assert parse_loadavg(text) == expected


# --------------------------------------------------------------------------- /proc/<pid>/stat


def _stat_line(pid: int, comm: str, pgrp: int, utime: int, stime: int, rss: int) -> str:
    # fields 3.. : state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime
    # cutime cstime priority nice num_threads itrealvalue starttime vsize rss ...
    fields = ["S", "1", str(pgrp), str(pgrp), "0", "-1", "4194560", "100", "0", "0", "0"]
    fields += [str(utime), str(stime), "0", "0", "20", "0", "4", "0", "12345", "1000000", str(rss)]
    fields += ["18446744073709551615"] + ["0"] * 30
    return f"{pid} ({comm}) " + " ".join(fields) + "\n"


def test_pid_stat_with_spaces_and_parentheses_in_name() -> None:
    stat = parse_pid_stat(_stat_line(4242, "vllm (worker) 1", 4200, 150, 50, 2048))
    assert stat is not None
    assert (stat.pid, stat.comm, stat.pgrp, stat.cpu_ticks, stat.rss_pages) == (
        4242,
        "vllm (worker) 1",
        4200,
        200,
        2048,
    )
    assert parse_proc_pid_stat(_stat_line(1, "init", 1, 7, 3, 99)) == (10, 99)


@pytest.mark.parametrize("text", ["", "1 (x) S 0", "no parens at all", "x (y) " + "z " * 40])
def test_pid_stat_odd_input(text: str) -> None:
    assert parse_proc_pid_stat(text) is None


def test_process_group_usage(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    members = {100: (100, 30, 10, 1000), 101: (100, 5, 5, 500), 200: (200, 999, 999, 9999)}
    for pid, (pgrp, utime, stime, rss) in members.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(_stat_line(pid, f"p{pid}", pgrp, utime, stime, rss))
    (proc / "102").mkdir()  # a process that exited between listdir and open
    (proc / "self").mkdir()
    (proc / "meminfo").write_text("MemTotal: 1 kB\n")
    usage = process_group_usage(str(tmp_path), 100, clk_tck=100, page_size=4096)
    assert usage is not None
    assert usage.processes == 2
    assert usage.pids == [100, 101]
    cpu_time = usage.cpu_seconds
    assert cpu_time == pytest.approx((30 + 10 + 5 + 5) / 100)
    assert usage.rss_bytes == (1000 + 500) * 4096
    nobody = process_group_usage(str(tmp_path), 999, clk_tck=100, page_size=4096)
    assert nobody is not None and nobody.processes == 0 and nobody.rss_bytes == 0
    assert process_group_usage(str(tmp_path / "missing"), 100, clk_tck=100, page_size=4096) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_process_group_usage_on_this_process() -> None:
    usage = process_group_usage("/", os.getpgrp(), os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE"))
    assert usage is not None
    assert os.getpid() in usage.pids
    assert usage.rss_bytes > 0


# --------------------------------------------------------------------------- fuzz


@settings(max_examples=examples(60), deadline=None)
@given(st.text(max_size=400))
def test_fuzzed_never_raises(text: str) -> None:
    for cpu in (parse_cpuinfo(text), parse_lscpu(text)):
        assert isinstance(cpu, CpuInfo)
        avx_warning(cpu)
    parse_proc_stat(text)
    parse_meminfo(text)
    parse_loadavg(text)
    parse_proc_pid_stat(text)


def test_h200_vm_cpu_and_memory_from_our_capture() -> None:
    cpu = parse_lscpu(fixture_text("lscpu", "xeon-16-vcpu-vm-h200.txt"))
    assert (cpu.logical_cpus, cpu.sockets, cpu.cores_per_socket, cpu.threads_per_core) == (16, 1, 16, 1)
    assert cpu.has_avx2 and cpu.has_avx512 and "amx_tile" in cpu.flags and avx_warning(cpu) is None
    assert parse_cpuinfo(fixture_text("proc-cpuinfo", "xeon-16-vcpu-vm-h200.txt")).logical_cpus == 16
    memory = parse_meminfo(fixture_text("proc-meminfo", "vm-128gb-h200.txt"))
    assert (memory.total_bytes, memory.available_bytes) == (135148564480, 134594818048)
    assert parse_proc_stat(fixture_text("proc-stat", "vm-16-vcpu-h200.txt")).per_cpu == 16
