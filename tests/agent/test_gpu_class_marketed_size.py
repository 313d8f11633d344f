"""The marketed memory size in a GPU class, from framebuffer totals real cards report."""

from __future__ import annotations

import pytest
from fixturefiles import fixture_text
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.probes.nvidia import gpu_class, nvidia_class_memory_gb, parse_nvidia_smi_text, parse_nvidia_smi_xml
from tests.budget import examples

# (product name, FB Memory Usage > Total in MiB, expected class).  Where each total comes from:
REPORTED_TOTALS = [
    # fixtures nvidia-smi-q/h100-nvl-x2-drv550.txt; also the plain nvidia-smi table in
    # NVIDIA/gpu-admin-tools issue #4 ("0MiB / 95830MiB", driver 535.183.01)
    ("NVIDIA H100 NVL", 95830, "H100NVL-94GB"),
    # sgawe11/rag-on-gh200 @ 04aabc9b README.md: nvidia-smi, driver 570.133.20, "48427MiB / 97871MiB"
    ("NVIDIA GH200 480GB", 97871, "GH200-96GB"),
    # vllm-project/vllm issue #27542 (comment): nvidia-smi, driver 580.105.08, "NVIDIA RTX PRO 6000
    # Blac..." with "94490MiB / 97887MiB"; the full product names as the driver reports them are in
    # vllm-project/vllm issues #23781 (Workstation Edition) and #32109 (Server Edition)
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 97887, "RTXPRO6000BlackwellWorkstationEdition-96GB"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, "RTXPRO6000BlackwellServerEdition-96GB"),
    # fixtures nvidia-smi-q/h100-80gb-hbm3-x8-drv535.161-fabric-completed.txt and four more
    ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
    # fixtures nvidia-smi-q/h200-*.txt and tests/agent/captured/nvidia-smi-q/h200-drv580-idle.txt
    ("NVIDIA H200", 143771, "H200-141GB"),
    # NVIDIA/TensorRT-LLM issue #10278: nvidia-smi, driver 580.95.05, "166593MiB / 183359MiB"
    ("NVIDIA B200", 183359, "B200-180GB"),
    # fixtures nvidia-smi-q/a100-sxm4-80gb-x4-drv555-fabric-na.txt
    ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
    # fixtures nvidia-smi-q-xml/a100-sxm4-40gb-mig-2-instances-passthrough-drv510.xml
    ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
    # fixtures nvidia-smi-q/l40s-drv550.txt
    ("NVIDIA L40S", 46068, "L40S-48GB"),
    # fixtures nvidia-smi-q/rtx4090-x8-drv535.154-idle.txt
    ("NVIDIA GeForce RTX 4090", 24564, "RTX4090-24GB"),
    # fixtures nvidia-smi-q/a10-drv535.129.txt
    ("NVIDIA A10", 23028, "A10-24GB"),
    # fixtures nvidia-smi-q-xml/tesla-t4-aws-drv515.xml
    ("Tesla T4", 15360, "T4-16GB"),
]


@pytest.mark.parametrize(("name", "total_mib", "expected"), REPORTED_TOTALS)
def test_a_reported_total_snaps_to_the_marketed_size(name: str, total_mib: int, expected: str) -> None:
    assert gpu_class(name, total_mib) == expected


def test_96_gb_cards_are_not_classed_94_gb() -> None:
    # 97871 MiB is 95.6 GiB: 94 GB lies inside the old "first size within 12 %" window too
    assert nvidia_class_memory_gb(97871) == 96
    assert nvidia_class_memory_gb(97887) == 96
    assert nvidia_class_memory_gb(95830) == 94


# Totals exactly between 94 and 96 GB (95.0 GiB): not readings of a real card, but where the
# total alone cannot tell and the name has to.
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 NVL", 94),  # the 94 GB part
        ("NVIDIA GH200 480GB", 96),  # 480GB is the superchip's CPU+GPU memory, not a candidate
        ("Some Card 94GB", 94),  # the name states its size
        ("Some Card", 96),  # cards report less than their marketed size, so the larger
        (None, 96),
    ],
)
def test_a_total_equally_near_two_sizes_is_settled_by_the_name(name: str | None, expected: int) -> None:
    assert nvidia_class_memory_gb(97280, name) == expected


def test_the_name_does_not_override_a_clear_total() -> None:
    assert nvidia_class_memory_gb(97871, "NVIDIA H100 NVL") == 96
    assert nvidia_class_memory_gb(81559, "NVIDIA H100 NVL") == 80


def test_a_total_near_no_marketed_size_is_rounded() -> None:
    assert nvidia_class_memory_gb(26 * 1024) == 26
    assert nvidia_class_memory_gb(1) == 1


# Every GPU in every nvidia-smi fixture, with the class it had before the sizes were snapped by
# nearness (none of them changed).
FIXTURE_CLASSES = {
    ("nvidia-smi-q", "a10-drv535.129.txt"): "A10-24GB",
    ("nvidia-smi-q", "a100-sxm4-80gb-x4-drv555-fabric-na.txt"): "A100-80GB",
    ("nvidia-smi-q", "gtx680-kepler-drv470-legacy-format.txt"): "GTX680-2GB",
    ("nvidia-smi-q", "h100-80gb-hbm3-vm-drv590-gpu-burn-load-masked.txt"): "H100-80GB",
    ("nvidia-smi-q", "h100-80gb-hbm3-vm-drv590-idle-masked.txt"): "H100-80GB",
    ("nvidia-smi-q", "h100-80gb-hbm3-x8-drv535.161-fabric-completed.txt"): "H100-80GB",
    ("nvidia-smi-q", "h100-80gb-hbm3-x8-drv535.183-passthrough-vm.txt"): "H100-80GB",
    ("nvidia-smi-q", "h100-mig-enabled-drv590-idle-masked.txt"): "H100-80GB",
    ("nvidia-smi-q", "h100-nvl-x2-drv550.txt"): "H100NVL-94GB",
    ("nvidia-smi-q", "h100-sxm-80gb-x8-drv565-fabric-clique0-zero-uuid.txt"): "H100-80GB",
    ("nvidia-smi-q", "h200-drv580-idle.txt"): "H200-141GB",
    ("nvidia-smi-q", "h200-drv580-one-compute-process.txt"): "H200-141GB",
    ("nvidia-smi-q", "h200-mig-enabled-drv590-load-masked.txt"): "H200-141GB",
    ("nvidia-smi-q", "h200-vm-drv590-load-masked.txt"): "H200-141GB",
    ("nvidia-smi-q", "h200-x1-passthrough-vm-drv550-fabric-completed-clique0.txt"): "H200-141GB",
    ("nvidia-smi-q", "l4-drv550.txt"): "L4-24GB",
    ("nvidia-smi-q", "l40s-drv550.txt"): "L40S-48GB",
    ("nvidia-smi-q", "l40s-drv595-load-masked.txt"): "L40S-48GB",
    ("nvidia-smi-q", "rtx2080super-linux-drv610-idle-masked.txt"): "RTX2080SUPER-8GB",
    ("nvidia-smi-q", "rtx2080super-windows-drv610-load-masked.txt"): "RTX2080SUPER-8GB",
    ("nvidia-smi-q", "rtx4090-x8-drv535.154-busy-p2.txt"): "RTX4090-24GB",
    ("nvidia-smi-q", "rtx4090-x8-drv535.154-idle.txt"): "RTX4090-24GB",
    ("nvidia-smi-q", "rtx5090-blackwell-drv570.txt"): "RTX5090-32GB",
    ("nvidia-smi-q", "rtx6000-ada-x8-drv550.txt"): "RTX6000Ada-48GB",
    ("nvidia-smi-q", "titan-v-volta-drv560.txt"): "TITANV-12GB",
    ("nvidia-smi-q", "v100-sxm2-16gb-x8-drv550.txt"): "V100-16GB",
    ("nvidia-smi-q-xml", "a100-sxm4-40gb-mig-2-instances-passthrough-drv510.xml"): "A100-40GB",
    ("nvidia-smi-q-xml", "a100-sxm4-80gb-mig-enabled-drv535-1of4gpus.xml"): "A100-80GB",
    ("nvidia-smi-q-xml", "a10g-aws-drv515.xml"): "A10G-24GB",
    ("nvidia-smi-q-xml", "gtx1660ti-graphics-device-drv418.xml"): "GraphicsDevice-6GB",
    ("nvidia-smi-q-xml", "h200-drv580-idle.xml"): "H200-141GB",
    ("nvidia-smi-q-xml", "h200-drv580-one-compute-process.xml"): "H200-141GB",
    ("nvidia-smi-q-xml", "quadro-p2000-drv525.xml"): "P2000-5GB",
    ("nvidia-smi-q-xml", "quadro-p400-drv418-schema-v10.xml"): "P400-2GB",
    ("nvidia-smi-q-xml", "rtx-a5000-x2-drv590.xml"): "RTXA5000-24GB",
    ("nvidia-smi-q-xml", "rtx2080-windows-wddm-many-processes-drv516.xml"): "RTX2080-8GB",
    ("nvidia-smi-q-xml", "rtx2080-x2-drv590.xml"): "RTX2080-8GB",
    ("nvidia-smi-q-xml", "rtx3060-drv570.xml"): "RTX3060-12GB",
    ("nvidia-smi-q-xml", "rtx3060-laptop-drv515.xml"): "RTX3060Laptop-6GB",
    ("nvidia-smi-q-xml", "rtx3080-drv595-schema-v13.xml"): "RTX3080-10GB",
    ("nvidia-smi-q-xml", "rtx3080-windows-drv536.xml"): "RTX3080-10GB",
    ("nvidia-smi-q-xml", "rtx3090-drv525.xml"): "RTX3090-24GB",
    ("nvidia-smi-q-xml", "rtx3090-drv590-schema-v13.xml"): "RTX3090-24GB",
    ("nvidia-smi-q-xml", "rtx4000-sff-ada-drv595.xml"): "RTX4000SFFAda-20GB",
    ("nvidia-smi-q-xml", "tesla-p100-pcie-16gb-drv510.xml"): "P100-16GB",
    ("nvidia-smi-q-xml", "tesla-t4-aws-drv515.xml"): "T4-16GB",
}


@pytest.mark.parametrize(("folder", "name"), sorted(FIXTURE_CLASSES), ids=lambda v: str(v))
def test_fixture_gpus_keep_their_class(folder: str, name: str) -> None:
    text = fixture_text(folder, name)
    report = parse_nvidia_smi_xml(text) if folder.endswith("xml") else parse_nvidia_smi_text(text)
    assert {g.gpu_class for g in report.gpus} == {FIXTURE_CLASSES[(folder, name)]}


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(min_value=-10, max_value=10**9), st.one_of(st.none(), st.text(max_size=60)))
def test_any_total_and_name_give_a_size_or_none(total_mib: int, name: str | None) -> None:
    size = nvidia_class_memory_gb(total_mib, name)
    if total_mib <= 0:
        assert size is None
    else:
        assert isinstance(size, int) and size >= 1
        assert size <= total_mib / 1024 * 1.12 + 1  # never snapped far above the reading
