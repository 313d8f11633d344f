"""Shard specs and the command lines of llama.cpp, vLLM and SGLang (pure functions; no engine runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agent.engines import (
    ShardSpec,
    build_command,
    health_path,
    llamacpp,
    parse_shard,
    serves_http,
    sglang,
    spec_fingerprint,
    vllm,
)
from tests import enginebin

REPO = Path(__file__).resolve().parents[2]


def item(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "shard": "qwen-r1-s0",
        "model": "qwen",
        "engine": "llama.cpp",
        "source": "/models/qwen.gguf",
        "api_key": "sk-shard-secret",
        "port": 18080,
    }
    base.update(overrides)
    return base


def spec(**overrides: Any) -> ShardSpec:
    return parse_shard(item(**overrides))


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


# --------------------------------------------------------------------------- parse_shard


def test_parse_defaults() -> None:
    s = spec()
    assert s.served_name == "qwen"
    assert s.host == "127.0.0.1"
    assert s.gpu_indices == [] and s.is_cpu
    assert s.cpu_cores == 0.0 and s.memory_bytes == 0
    assert s.context_size is None and s.parallel == 1
    assert s.extra_args == [] and s.env == {}
    assert (s.nodes_per_replica, s.rank, s.master_addr, s.master_port) == (1, 0, None, None)
    assert s.tensor_parallel is None and s.pipeline_parallel is None and s.generation == 0


def test_parse_full_and_ignores_unknown_fields() -> None:
    s = spec(
        served_name="qwen-7b",
        gpu_indices=[2, 3],
        cpu_cores=3.5,
        memory_bytes=8 << 30,
        context_size=4096,
        parallel=8,
        extra_args=["--flash-attn", "on"],
        env={"NCCL_SOCKET_IFNAME": "ib0"},
        host="0.0.0.0",
        generation=7,
        tensor_parallel=2,
        pipeline_parallel=1,
        something_new={"x": 1},
    )
    assert s.gpu_indices == [2, 3] and not s.is_cpu
    assert s.cpu_cores == 3.5 and s.memory_bytes == 8 << 30
    assert s.context_size == 4096 and s.parallel == 8
    assert s.extra_args == ["--flash-attn", "on"]
    assert s.env == {"NCCL_SOCKET_IFNAME": "ib0"}
    assert s.host == "0.0.0.0" and s.generation == 7
    assert s.to_dict()["served_name"] == "qwen-7b"
    assert parse_shard(s.to_dict()) == s


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"shard": ""}, "shard"),
        ({"shard": "../etc/passwd"}, "shard"),
        ({"shard": 12}, "shard"),
        ({"engine": "ollama"}, "engine"),
        ({"engine": None}, "engine"),
        ({"model": 3}, "model"),
        ({"source": "models/x.gguf"}, "source"),
        ({"source": None}, "source"),
        ({"api_key": ""}, "api_key"),
        ({"api_key": None}, "api_key"),
        ({"api_key": "a,b"}, "api_key"),
        ({"port": "8080"}, "port"),
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"port": True}, "port"),
        ({"host": "bad host!"}, "host"),
        ({"gpu_indices": "0,1"}, "gpu_indices"),
        ({"gpu_indices": [0, -1]}, "gpu_indices[1]"),
        ({"gpu_indices": [1, 1]}, "gpu_indices"),
        ({"cpu_cores": "2"}, "cpu_cores"),
        ({"cpu_cores": -1}, "cpu_cores"),
        ({"memory_bytes": 1.5}, "memory_bytes"),
        ({"context_size": 0}, "context_size"),
        ({"parallel": 0}, "parallel"),
        ({"extra_args": "--foo"}, "extra_args"),
        ({"extra_args": ["--ok", 3]}, "extra_args[1]"),
        ({"env": ["A=1"]}, "env"),
        ({"env": {"A": 1}}, "env.A"),
        ({"env": {"BAD-NAME": "1"}}, "env"),
        ({"nodes_per_replica": 0}, "nodes_per_replica"),
        ({"nodes_per_replica": 2, "rank": 2, "master_addr": "10.0.0.1", "master_port": 29500}, "rank"),
        ({"nodes_per_replica": 2}, "master_addr/master_port"),
        ({"tensor_parallel": 0}, "tensor_parallel"),
        ({"pipeline_parallel": "2"}, "pipeline_parallel"),
        ({"generation": "1"}, "generation"),
    ],
)
def test_parse_rejects_naming_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        parse_shard(item(**overrides))
    assert str(excinfo.value).startswith(field + ":"), str(excinfo.value)


def test_parse_rejects_a_missing_field_and_a_non_object() -> None:
    data = item()
    del data["port"]
    with pytest.raises(ValueError, match="^port: missing"):
        parse_shard(data)
    with pytest.raises(ValueError, match="^shard: expected an object"):
        parse_shard(["not", "an", "object"])


def test_fingerprint_changes_only_with_what_needs_a_restart() -> None:
    base = spec(context_size=2048, parallel=2, cpu_cores=2)
    same = spec_fingerprint(base)
    assert spec_fingerprint(spec(context_size=2048, parallel=2, cpu_cores=2)) == same
    # bookkeeping fields do not restart the engine
    assert (
        spec_fingerprint(spec(context_size=2048, parallel=2, cpu_cores=2, model="renamed", served_name="qwen")) == same
    )
    assert spec_fingerprint(spec(context_size=2048, parallel=2, cpu_cores=2, memory_bytes=1 << 30)) == same
    for change in (
        {"parallel": 3},
        {"context_size": 4096},
        {"cpu_cores": 3},
        {"api_key": "other"},
        {"port": 18081},
        {"gpu_indices": [0]},
        {"extra_args": ["-fa", "on"]},
        {"env": {"X": "1"}},
        {"generation": 1},
        {"source": "/models/other.gguf"},
        {"served_name": "other"},
        {"host": "0.0.0.0"},
    ):
        params = {"context_size": 2048, "parallel": 2, "cpu_cores": 2, **change}
        assert spec_fingerprint(spec(**params)) != same, change


# --------------------------------------------------------------------------- llama.cpp


def test_llamacpp_cpu_shard() -> None:
    s = spec(cpu_cores=1, parallel=2, context_size=512, served_name="tiny")
    argv, env = build_command(s, "/opt/llama/llama-server")
    assert argv == [
        "/opt/llama/llama-server",
        "-m",
        "/models/qwen.gguf",
        "--host",
        "127.0.0.1",
        "--port",
        "18080",
        "--alias",
        "tiny",
        "--ctx-size",
        "1024",  # llama-server splits it between the 2 slots: 512 each
        "--parallel",
        "2",
        "--threads",
        "1",
        "--metrics",
        "--no-webui",
    ]
    assert "-ngl" not in argv
    assert env == {"LLAMA_API_KEY": "sk-shard-secret", "CUDA_VISIBLE_DEVICES": ""}
    assert not any("sk-shard-secret" in a for a in argv), "the key must not show in ps"
    assert serves_http(s) and health_path(s) == "/health"


def test_llamacpp_gpu_shard_extra_args_and_env() -> None:
    s = spec(
        gpu_indices=[1, 3],
        cpu_cores=2.6,
        extra_args=["--flash-attn", "on"],
        env={"GGML_CUDA_NO_PINNED": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "LLAMA_API_KEY": "nope"},
    )
    argv, env = build_command(s, "llama-server")
    assert flag(argv, "-ngl") == "999"
    assert flag(argv, "--threads") == "3"
    assert "--ctx-size" not in argv  # unset: the model's own context
    assert argv[-2:] == ["--flash-attn", "on"]
    # the operator's env is merged, but placement's GPUs and the shard's key always win
    assert env == {"GGML_CUDA_NO_PINNED": "1", "CUDA_VISIBLE_DEVICES": "1,3", "LLAMA_API_KEY": "sk-shard-secret"}


@pytest.mark.parametrize(("cores", "threads"), [(0, 1), (0.2, 1), (1, 1), (1.5, 2), (2.4, 2), (16, 16)])
def test_llamacpp_threads(cores: float, threads: int) -> None:
    assert llamacpp.threads(spec(cpu_cores=cores)) == threads


def test_llamacpp_refuses_multi_node() -> None:
    s = spec(nodes_per_replica=2, master_addr="10.0.0.1", master_port=29500)
    with pytest.raises(ValueError, match="nodes_per_replica"):
        build_command(s, "llama-server")


# --------------------------------------------------------------------------- vLLM


def test_vllm_single_node() -> None:
    s = spec(
        engine="vllm",
        source="/models/qwen",
        served_name="qwen-7b",
        gpu_indices=[0, 1],
        context_size=8192,
        parallel=64,
        extra_args=["--enable-prefix-caching"],
    )
    argv, env = build_command(s, "/opt/vllm/bin/vllm")
    assert argv == [
        "/opt/vllm/bin/vllm",
        "serve",
        "/models/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "18080",
        "--served-model-name",
        "qwen-7b",
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "1",
        "--max-model-len",
        "8192",
        "--max-num-seqs",
        "64",
        "--enable-prefix-caching",
    ]
    assert env == {"VLLM_API_KEY": "sk-shard-secret", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert "--nnodes" not in argv and "--headless" not in argv
    assert serves_http(s) and health_path(s) == "/health"


def multi(engine: str, rank: int, **overrides: Any) -> ShardSpec:
    params: dict[str, Any] = {
        "engine": engine,
        "source": "/models/big",
        "gpu_indices": list(range(8)),
        "nodes_per_replica": 2,
        "rank": rank,
        "master_addr": "10.0.0.1",
        "master_port": 29500,
        "parallel": 32,
        "env": {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_DEBUG": "INFO"},
    }
    params.update(overrides)
    return spec(**params)


def test_vllm_multi_node_ranks() -> None:
    head_argv, head_env = build_command(multi("vllm", 0), "vllm")
    assert flag(head_argv, "--tensor-parallel-size") == "8"
    assert flag(head_argv, "--pipeline-parallel-size") == "2"
    assert flag(head_argv, "--distributed-executor-backend") == "mp"
    assert flag(head_argv, "--nnodes") == "2"
    assert flag(head_argv, "--node-rank") == "0"
    assert flag(head_argv, "--master-addr") == "10.0.0.1"
    assert flag(head_argv, "--master-port") == "29500"
    assert "--headless" not in head_argv
    assert head_env["NCCL_IB_DISABLE"] == "0"
    assert head_env["NCCL_DEBUG"] == "INFO"  # the spec's env wins over the default WARN
    assert head_env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert head_env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"

    worker = multi("vllm", 1, env={})
    argv, env = build_command(worker, "vllm")
    assert flag(argv, "--node-rank") == "1"
    assert "--headless" in argv
    assert env["NCCL_DEBUG"] == "WARN" and env["NCCL_IB_DISABLE"] == "0"
    assert not serves_http(worker)


def test_vllm_parallel_sizes() -> None:
    assert vllm.parallel_sizes(multi("vllm", 0, tensor_parallel=16)) == (16, 1)
    assert vllm.parallel_sizes(multi("vllm", 0, pipeline_parallel=4)) == (4, 4)
    assert vllm.parallel_sizes(spec(engine="vllm", source="/m")) == (1, 1)  # CPU
    with pytest.raises(ValueError, match=r"8 x 1 = 8, but the replica has 8 GPUs on each of 2 node\(s\) = 16"):
        build_command(multi("vllm", 0, tensor_parallel=8, pipeline_parallel=1), "vllm")


# --------------------------------------------------------------------------- SGLang


def test_sglang_single_node() -> None:
    s = spec(
        engine="sglang",
        source="/models/qwen",
        served_name="qwen-7b",
        gpu_indices=[4, 5, 6, 7],
        context_size=32768,
        parallel=128,
    )
    argv, env = build_command(s, "/opt/sglang/bin/python")
    assert argv == [
        "/opt/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "18080",
        "--api-key",
        "sk-shard-secret",
        "--served-model-name",
        "qwen-7b",
        "--tp",
        "4",
        "--context-length",
        "32768",
        "--max-running-requests",
        "128",
        "--enable-metrics",
    ]
    assert env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}


def test_sglang_multi_node_and_cpu() -> None:
    argv, env = build_command(multi("sglang", 1, pipeline_parallel=2), "python3")
    assert flag(argv, "--tp") == "8"
    assert flag(argv, "--pp-size") == "2"
    assert flag(argv, "--nnodes") == "2"
    assert flag(argv, "--node-rank") == "1"
    assert flag(argv, "--dist-init-addr") == "10.0.0.1:29500"
    assert env["NCCL_IB_DISABLE"] == "0"
    argv, _ = build_command(multi("sglang", 0), "python3")
    assert flag(argv, "--tp") == "16" and "--pp-size" not in argv
    assert not serves_http(multi("sglang", 1)) and serves_http(multi("sglang", 0))
    ipv6 = multi("sglang", 0, master_addr="fd00::1")
    assert sglang.dist_init_addr(ipv6) == "[fd00::1]:29500"
    argv, env = build_command(spec(engine="sglang", source="/models/tiny"), "python3")
    assert flag(argv, "--device") == "cpu" and env == {"CUDA_VISIBLE_DEVICES": ""}


# --------------------------------------------------------------------------- finding llama-server


def test_enginebin_env_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("LLMGW_LLAMA_SERVER", str(binary))
    assert enginebin.llama_server_path() == binary
    monkeypatch.setenv("LLMGW_LLAMA_SERVER", str(tmp_path / "absent"))
    assert enginebin.llama_server_path() is None
    assert "is not an executable file" in enginebin.missing_reason()


def test_enginebin_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(enginebin, "REPO_ROOT", tmp_path / "nowhere" / "repo")
    assert enginebin.llama_server_path() is None
    cached = tmp_path / "llmgw" / "llama-server" / enginebin.LLAMA_CPP_VERSION / "llama-server"
    assert enginebin.cache_path() == cached
    cached.parent.mkdir(parents=True)
    cached.write_text("#!/bin/sh\n")
    cached.chmod(0o755)
    assert enginebin.llama_server_path() == cached


SCRIPT = REPO / "scripts" / "ensure-llama-server"


def run_script(*args: str, env: dict[str, str], script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": os.environ["PATH"], **env},
    )


def test_ensure_script_is_valid_bash() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_ensure_script_finds_a_binary(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    done = run_script(env={"HOME": str(tmp_path), "LLMGW_LLAMA_SERVER": str(binary)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{binary}\n"
    done = run_script(env={"HOME": str(tmp_path), "LLMGW_LLAMA_SERVER": str(tmp_path / "absent")})
    assert done.returncode == 1 and "not an executable file" in done.stderr


def test_ensure_script_finds_the_cache_and_checks_without_building(tmp_path: Path) -> None:
    # A copy of the script in a repository without ../shared/bin, so only the cache can answer.
    repo = tmp_path / "elsewhere" / "repo"
    (repo / "scripts").mkdir(parents=True)
    script = repo / "scripts" / "ensure-llama-server"
    shutil.copy(SCRIPT, script)
    env = {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = run_script("--check", env=env, script=script)
    assert done.returncode == 1 and "no llama-server found" in done.stderr and done.stdout == ""
    cached = tmp_path / "cache" / "llmgw" / "llama-server" / enginebin.LLAMA_CPP_VERSION / "llama-server"
    cached.parent.mkdir(parents=True)
    cached.write_text("#!/bin/sh\n")
    cached.chmod(0o755)
    done = run_script(env=env, script=script)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{cached}\n"
    shared = tmp_path / "elsewhere" / "shared" / "bin" / "llama-server"
    shared.parent.mkdir(parents=True)
    shared.write_text("#!/bin/sh\n")
    shared.chmod(0o755)
    done = run_script("--check", env=env, script=script)
    assert done.stdout == f"{shared}\n", "the shared prebuilt binary comes before the cache"
