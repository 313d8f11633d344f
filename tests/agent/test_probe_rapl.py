"""Intel RAPL powercap energy counters and package power."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixturefiles import fixture_files, fixture_text, read_text

from agent.probes.rapl import RaplSample, RaplZone, energy_delta_uj, package_power_w, read_rapl, tree_from_grep_r

FOLDER = "rapl-powercap"
MAX_RANGE = 262143328850  # the usual Intel wrap value, as in the fixture


@pytest.mark.parametrize("path", fixture_files(FOLDER))
def test_rapl_fixture_parses(path: Path) -> None:
    sample = read_rapl(tree_from_grep_r(read_text(path)), timestamp=1.0)
    assert sample.warnings == []
    packages = [z for z in sample.zones.values() if z.name and z.name.startswith("package-")]
    assert packages
    for zone in sample.zones.values():
        assert zone.energy_uj is not None and zone.max_energy_range_uj
        assert 0 <= zone.energy_uj <= zone.max_energy_range_uj


def test_rapl_fixture_values() -> None:
    sample = read_rapl(
        tree_from_grep_r(fixture_text(FOLDER, "sysfs-intel-rapl-package-core-node-exporter-fixture-grep-r.txt"))
    )
    assert sample.zones == {
        "intel-rapl:0": RaplZone(name="package-0", energy_uj=240422366267, max_energy_range_uj=MAX_RANGE),
        "intel-rapl:0:0": RaplZone(name="core", energy_uj=118821284256, max_energy_range_uj=MAX_RANGE),
    }
    assert sample.timestamp > 0


def _sample(timestamp: float, zones: dict[str, tuple[str, int | None]]) -> RaplSample:
    return RaplSample(
        timestamp=timestamp,
        zones={zid: RaplZone(name, energy, MAX_RANGE) for zid, (name, energy) in zones.items()},
    )


def test_package_power_counts_only_package_zones() -> None:
    prev = _sample(100.0, {"intel-rapl:0": ("package-0", 240422366267), "intel-rapl:0:0": ("core", 118821284256)})
    cur = _sample(102.0, {"intel-rapl:0": ("package-0", 240422366267 + 300_000_000), "intel-rapl:0:0": ("core", 1)})
    assert package_power_w(prev, cur) == {"package-0": pytest.approx(150.0)}


def test_package_power_across_a_wrap_and_two_sockets() -> None:
    prev = _sample(10.0, {"intel-rapl:0": ("package-0", MAX_RANGE - 40_000_000), "intel-rapl:1": ("package-1", 5)})
    cur = _sample(11.0, {"intel-rapl:0": ("package-0", 60_000_000), "intel-rapl:1": ("package-1", 80_000_005)})
    assert package_power_w(prev, cur) == {"package-0": pytest.approx(100.0), "package-1": pytest.approx(80.0)}


def test_package_power_missing_or_unreadable_is_absent() -> None:
    prev = _sample(10.0, {"intel-rapl:0": ("package-0", None), "intel-rapl:1": ("package-1", 5)})
    cur = _sample(11.0, {"intel-rapl:0": ("package-0", 10), "intel-rapl:2": ("package-2", 5)})
    assert package_power_w(prev, cur) == {}
    same_time = _sample(10.0, {"intel-rapl:1": ("package-1", 50)})
    assert package_power_w(prev, same_time) == {}


@pytest.mark.parametrize(
    ("prev", "cur", "max_range", "expected"),
    [
        (100, 250, MAX_RANGE, 150),
        (100, 100, MAX_RANGE, 0),
        (MAX_RANGE - 10, 5, MAX_RANGE, 15),
        (100, 50, None, None),  # went back without a known range
        (100, 50, 0, None),
        (MAX_RANGE + 5, 1, MAX_RANGE, None),  # prev beyond the range: not a single wrap
        (None, 50, MAX_RANGE, None),
        (50, None, MAX_RANGE, None),
    ],
)
def test_energy_delta(prev: int | None, cur: int | None, max_range: int | None, expected: int | None) -> None:
    assert energy_delta_uj(prev, cur, max_range) == expected


def test_read_rapl_real_root_with_unreadable_counter(tmp_path: Path) -> None:
    base = tmp_path / "sys" / "class" / "powercap"
    for zone, name, energy in (("intel-rapl:0", "package-0", "123456"), ("intel-rapl:1", "package-1", None)):
        (base / zone).mkdir(parents=True)
        (base / zone / "name").write_text(name + "\n")
        (base / zone / "max_energy_range_uj").write_text(f"{MAX_RANGE}\n")
        if energy is not None:
            (base / zone / "energy_uj").write_text(energy + "\n")
    (base / "intel-rapl-mmio:0").mkdir()  # the MMIO duplicate of package-0: must not be read
    (base / "intel-rapl-mmio:0" / "name").write_text("package-0\n")
    sample = read_rapl(str(tmp_path), timestamp=5.0)
    assert sample.timestamp == 5.0
    assert sorted(sample.zones) == ["intel-rapl:0", "intel-rapl:1"]
    assert sample.zones["intel-rapl:0"].energy_uj == 123456
    assert sample.zones["intel-rapl:1"].energy_uj is None
    assert any("intel-rapl:1" in w and "root" in w for w in sample.warnings)


def test_read_rapl_nothing_there(tmp_path: Path) -> None:
    sample = read_rapl(str(tmp_path), timestamp=1.0)
    assert sample.zones == {}
    assert sample.warnings
