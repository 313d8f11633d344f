"""How long the fabric page takes to draw one frame, in Debian's Chromium.

    .venv/bin/python bench/fabric_drawing.py [--frames 60]

Serves the page's own script (console/fabric.js) and d3 from a local folder with the map of
the 206-switch SuperPOD capture (parsed and laid out as the control plane gives it), and
zooms it with the mouse wheel: each wheel event redraws the whole canvas synchronously. The
median time per frame is printed, with frames per second, against a baseline measured in the
same run: the same page drawing a fabric of two switches and two adapters. Target: a frame of
the 206-switch fabric in at most 16 ms (60 frames a second).

The capture is found as the tests find it ($LLMGW_FIXTURES_DIR, else ../shared/fixtures beside the
clone, else tests/agent/captured; folder ``ibnetdiscover``). The load average is printed at the
start and the end, and the target as met, missed, or not measured (no capture, no Chromium).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from apps.fabrics import topology  # noqa: E402
from bench.report import Report, fixture, fixture_roots  # noqa: E402

CAPTURE = "hdr-qm8790-3tier-fattree-206sw-1336ca-superpod-crlf-bom-prompt.txt"
TARGET_MS = 16.0
STATIC = REPO / "llmgw" / "console" / "static" / "console"
CHROMIUM = Path("/usr/bin/chromium")
TINY = """Switch\t4 "S-0000000000000001"\t\t# "leaf-a" base port 0 lid 1 lmc 0
[1]\t"H-00000000000000a1"[1](00000000000000a1) \t\t# "h1 mlx5_0" lid 3 4xHDR
[2]\t"S-0000000000000002"[2]\t\t# "spine-a" lid 2 4xHDR

Switch\t4 "S-0000000000000002"\t\t# "spine-a" base port 0 lid 2 lmc 0
[2]\t"S-0000000000000001"[2]\t\t# "leaf-a" lid 1 4xHDR

Ca\t1 "H-00000000000000a1"\t\t# "h1 mlx5_0"
[1](00000000000000a1) \t"S-0000000000000001"[1]\t\t# lid 3 lmc 0 "leaf-a" lid 1 4xHDR
"""
PAGE = """<!doctype html><html><body style="margin:0">
<canvas id="fabric-canvas" style="width:1280px;height:640px;display:block" data-url="view.json"
 data-refresh="600000"></canvas>
<aside id="fabric-panel"></aside><div id="fabric-legend"></div>
<script id="fabric-labels" type="application/json">{}</script>
<script src="d3.min.js"></script><script src="fabric.js"></script>
</body></html>"""
WHEEL = """async (frames) => {
  const canvas = document.getElementById("fabric-canvas");
  const rect = canvas.getBoundingClientRect();
  const times = [];
  for (let i = 0; i < frames; i++) {
    const event = new WheelEvent("wheel", {
      deltaY: i % 2 ? 40 : -40, clientX: rect.left + rect.width / 2, clientY: rect.top + rect.height / 2,
      bubbles: true, cancelable: true,
    });
    const start = performance.now();
    canvas.dispatchEvent(event);
    times.push(performance.now() - start);
    await new Promise((resolve) => requestAnimationFrame(resolve));
  }
  return times;
}"""


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        return None


def site(text: str, folder: Path) -> int:
    """Lay out the page for one map; the number of things it draws."""
    data = topology.to_dict(topology.parse(text))
    (folder / "view.json").write_text(json.dumps({"map": data, "live": {}, "taken_at": "now"}))
    (folder / "index.html").write_text(PAGE)
    shutil.copy(STATIC / "d3" / "d3.min.js", folder / "d3.min.js")
    shutil.copy(STATIC / "fabric.js", folder / "fabric.js")
    ports = sum(len(a["ports"]) for a in data["adapters"] if a["kind"] == "ca" and any(p["leaf"] for p in a["ports"]))
    return len(data["switches"]) + ports


def measure(browser: object, folder: Path, frames: int) -> tuple[list[float], str]:
    handler = functools.partial(Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page = browser.new_page(viewport={"width": 1280, "height": 700})  # type: ignore[attr-defined]
        page.goto(f"http://127.0.0.1:{server.server_address[1]}/index.html")
        page.wait_for_selector("#fabric-canvas[data-drawn]", timeout=30_000)
        drawn = page.get_attribute("#fabric-canvas", "data-drawn") or "?"
        times = page.evaluate(WHEEL, frames)
        page.close()
        return times, drawn
    finally:
        server.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=60)
    args = parser.parse_args()
    with Report(__doc__) as report:
        capture = fixture("ibnetdiscover", CAPTURE)
        if capture is None:
            roots = ", ".join(str(root) for root in fixture_roots())
            report.not_measured("frame", f"ibnetdiscover/{CAPTURE} not found in {roots} (set LLMGW_FIXTURES_DIR)")
            return
        if not CHROMIUM.is_file():
            report.not_measured("frame", f"no browser at {CHROMIUM} (apt-get install chromium)")
            return
        frame = run(capture, args.frames)
        report.target("frame", measured=frame, limit=TARGET_MS, unit=" ms")


def run(capture: Path, frames: int) -> float:
    """The median time of one frame of the capture's map, in ms."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as big_dir, tempfile.TemporaryDirectory() as tiny_dir:
        big = site(capture.read_text(encoding="utf-8", errors="replace"), Path(big_dir))
        tiny = site(TINY, Path(tiny_dir))
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            base, _ = measure(browser, Path(tiny_dir), frames)
            times, drawn = measure(browser, Path(big_dir), frames)
            browser.close()
    frame = statistics.median(times)
    baseline = statistics.median(base)
    print(f"206-switch SuperPOD capture: {big} things to draw (page says {drawn})")
    print(
        f"  one frame (zoom by wheel, whole canvas redrawn): median {frame:.2f} ms of {len(times)} "
        f"(p90 {sorted(times)[int(0.9 * len(times))]:.2f} ms), about {1000 / max(frame, 0.001):.0f} frames/s"
    )
    ratio = frame / max(baseline, 0.001)
    print(f"baseline, a fabric of {tiny} things on the same page: median {baseline:.2f} ms; ratio {ratio:.1f}x")
    return frame


if __name__ == "__main__":
    main()
