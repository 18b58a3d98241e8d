"""How fast the file store's pages reach the host pool's rows, through the reader's real code.

    python benchmarks/probes/store_read.py                       # 128 pages of 8 MiB, threads 1,2
    python benchmarks/probes/store_read.py --threads 1,2,4,8,16 --pages 256 --read-chunks 262144,0

Writes --pages pages of --page-bytes (random bytes; 64 tokens a page, a bf16 host pool of 8 KV
heads x 128 dims and as many layers as make the page: 8 MiB = Llama-3.1-8B's 32) to a store in a
temporary folder, reads every file once so the page cache holds them (the restart case this
measures: the store was written recently or read before), then reads them all back --rounds
times into one run of host slots through PageReader (its thread pool of F fetchers, READ_AHEAD
set to F) along each path:
  get          storage.get -> a fresh bytearray -> put_rows (the path for pages whose host
               slots are scattered; until 2026-11-28 also for runs, and get read the page in
               one read, then its CRC: results before that commit measure that read)
  direct       storage.get_into the page's host rows: readinto them in --read-chunks pieces,
               each CRC'd right after its read (0: the whole page in one read, then its CRC)
  native       direct through the native reader (storage/native_read.py: open, header, payload
               in NATIVE_CHUNK pieces each CRC'd, close in one C call, the GIL released once a
               page); its CRC is the store's (the --crcs and --read-chunks do not apply)
  read_only    no store and no checks: F threads readinto a buffer of their own, file after
               file (what the page cache alone delivers to one process)
Each of get and direct runs with every CRC-32 in --crcs: zlib's (the standard library's) and
zlib-ng's when installed (`pip install zlib-ng`; the store's default then); get with zlib is the
store's read before get_into. The host pool is pinned when CUDA is present (as the engine's
is), else lazily mapped RAM, touched once before the first read. One JSON line per (path, crc,
read chunk, threads): gb_s (best round), gb_s_median, tokens_s (64-token pages: the figure to
set beside a prefill's tokens/s). --spin: a thread runs Python beside the reads (the scheduler
launching forwards), with the engine's 0.5 ms switch interval (runtime/gil_switch.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from benchmarks.peers.compare import cpu_info, git_commit  # noqa: E402
from radixlm.runtime.mem_cache import page_reader  # noqa: E402
from radixlm.runtime.mem_cache.host_pool import HostKVPool  # noqa: E402
from radixlm.runtime.mem_cache.kv_pool import KVPool  # noqa: E402
from radixlm.runtime.mem_cache.page_reader import PageReader, PrefetchOp  # noqa: E402
from radixlm.runtime.mem_cache.storage import file_backend, native_read  # noqa: E402
from radixlm.runtime.mem_cache.storage.file_backend import FileStorage  # noqa: E402

CRCS = {"zlib": zlib.crc32}
if file_backend.CRC_IMPL == "zlib-ng":
    CRCS["zlib-ng"] = file_backend.crc32
PAGE_TOKENS, HEADS, DIM = 64, 8, 128
LAYER_BYTES = 2 * HEADS * DIM * 2  # K and V of one layer, one token, bf16


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--page-bytes", type=int, default=8 << 20)
    ap.add_argument("--threads", type=_ints, default=[1, 2], help="fetcher counts, e.g. 1,2,8")
    ap.add_argument("--paths", default="get,direct,read_only")
    ap.add_argument("--read-chunks", type=_ints, default=[file_backend.READ_CHUNK],
                    help="get_into's read size(s) in bytes for the direct path; 0: a whole page")
    ap.add_argument("--crcs", default=",".join(CRCS),
                    help="CRC-32 implementations to compare (zlib; zlib-ng when installed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spin", action="store_true",
                    help="a thread spinning in Python beside the reads (0.5 ms switch interval)")
    ap.add_argument("--dir", default=None, help="where the temporary store goes (default: TMPDIR)")
    ap.add_argument("--result-file", default=None,
                    help="also append the lines to this file (results/store_read-*.jsonl)")
    ap.add_argument("--note", default=None, help="free text stored with each line")
    args = ap.parse_args(argv)
    per_page = PAGE_TOKENS * LAYER_BYTES
    if args.page_bytes <= 0 or args.page_bytes % per_page:
        ap.error(f"--page-bytes must be a positive multiple of {per_page} (64 tokens x one "
                 f"layer's K and V of {HEADS} heads x {DIM} dims, bf16)")
    if args.pages <= 0 or args.rounds <= 0 or not args.threads or min(args.threads) <= 0:
        ap.error("--pages, --rounds and every --threads value must be positive")
    unknown = set(args.paths.split(",")) - {"get", "direct", "native", "read_only"}
    if unknown:
        ap.error(f"--paths: unknown {sorted(unknown)} (get, direct, native, read_only)")
    if "native" in args.paths.split(",") and native_read.reader() is None:
        ap.error("--paths native: the native reader did not build here (see the warning)")
    args.crcs = args.crcs.split(",")
    if set(args.crcs) - set(CRCS):
        ap.error(f"--crcs: {sorted(set(args.crcs) - set(CRCS))} not available here "
                 f"(this Python has {sorted(CRCS)}; `pip install zlib-ng` for zlib-ng)")
    return args


def _write_store(folder: str, pages: int, page_bytes: int) -> tuple[FileStorage, list[bytes]]:
    store = FileStorage(folder, "probe", page_bytes)
    gen = torch.Generator().manual_seed(0)
    keys = []
    for i in range(pages):
        key = i.to_bytes(32, "little")
        page = torch.randint(0, 256, (page_bytes,), generator=gen, dtype=torch.uint8)
        while not store.put(key, memoryview(page.numpy())):  # queue full: let it drain
            store.flush()
        keys.append(key)
    store.flush()
    for key in keys:  # into the page cache
        with open(store.path(key), "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    return store, keys


def _reader_round(host, store, keys, threads: int, direct: bool) -> float:
    page_reader.READ_AHEAD = threads  # the fetcher pool's size and the pages in flight
    reader = PageReader(host, PAGE_TOKENS, threaded=True, direct=direct)
    slots = torch.arange(1, 1 + len(keys) * PAGE_TOKENS)  # one run: every page direct
    op = PrefetchOp(store, (), 0, keys, PAGE_TOKENS, 0.0, found=len(keys), slots=slots,
                    reading=True)
    t0 = time.perf_counter()
    reader.read(op)
    reader.drain()
    seconds = time.perf_counter() - t0
    landed = max((n[2] for n in reader.news if n[0] == "landed"), default=0)
    reader.close()
    if landed != len(keys):
        raise SystemExit(f"only {landed} of {len(keys)} pages landed (see the warnings above)")
    return seconds


def _read_only_round(store, keys, threads: int, page_bytes: int) -> float:
    def worker(part):
        buf = bytearray(page_bytes + 64)
        for key in part:
            with open(store.path(key), "rb", buffering=0) as f:
                f.readinto(buf)

    parts = [keys[i::threads] for i in range(threads)]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(worker, parts))
        return time.perf_counter() - t0


class _Spinner:
    """A thread running Python until stopped, at the engine's 0.5 ms switch interval."""

    def __init__(self):
        sys.setswitchinterval(0.0005)
        self._stop = False
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self):
        n = 0
        while not self._stop:
            n += 1

    def stop(self):
        self._stop = True
        self._thread.join()


def main(argv=None) -> None:
    args = _args(argv)
    layers = args.page_bytes // (PAGE_TOKENS * LAYER_BYTES)
    pinned = torch.cuda.is_available()
    host = HostKVPool(args.pages * PAGE_TOKENS, KVPool(1, layers, HEADS, DIM, torch.bfloat16,
                                                      torch.device("cpu")),
                      torch.device("cuda" if pinned else "cpu"))
    host.kv.view(torch.int16).fill_(0)  # mapped before any read (the engine's pool is warm)
    folder = tempfile.mkdtemp(prefix="store-read-", dir=args.dir)
    try:
        store, keys = _write_store(folder, args.pages, args.page_bytes)
        nbytes = args.pages * args.page_bytes
        cpu = cpu_info()
        meta = {"device": (torch.cuda.get_device_name() + " host" if pinned else cpu["device"]),
                "cpu_model": cpu["cpu_model"], "git_commit": git_commit(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "command": "python " + " ".join(sys.argv), "note": args.note}
        arms = []
        for path in args.paths.split(","):
            if path == "native":
                arms += [(path, None, native_read.NATIVE_CHUNK, t) for t in args.threads]
                continue
            for crc in (args.crcs if path != "read_only" else [None]):
                for chunk in (args.read_chunks if path == "direct" else [None]):
                    arms += [(path, crc, chunk, t) for t in args.threads]
        spinner = _Spinner() if args.spin else None
        for path, crc, chunk, threads in arms:
            store.native = path == "native"
            if chunk is not None and path != "native":
                file_backend.READ_CHUNK = chunk or args.page_bytes
            if crc is not None:  # (looked up at each call: the store's reads use this one)
                file_backend.crc32 = CRCS[crc]
            times = []
            for _ in range(args.rounds):
                if path == "read_only":
                    times.append(_read_only_round(store, keys, threads, args.page_bytes))
                else:
                    times.append(_reader_round(host, store, keys, threads, path != "get"))
            best, median = min(times), statistics.median(times)
            line = json.dumps({
                "probe": "store_read", "path": path, "threads": threads, "read_chunk": chunk,
                "pages": args.pages, "page_bytes": args.page_bytes,
                "gb_s": round(nbytes / best / 1e9, 3),
                "gb_s_median": round(nbytes / median / 1e9, 3),
                "tokens_s": round(args.pages * PAGE_TOKENS / best),
                "crc": native_read.reader().crc_name if path == "native" else crc,
                "spin": args.spin, "rounds": args.rounds, "pinned": pinned, "cpus": os.cpu_count(),
                "load_avg": round(os.getloadavg()[0], 2), **meta})
            print(line, flush=True)
            if args.result_file:
                with open(args.result_file, "a") as f:
                    f.write(line + "\n")
        store.close()
        if spinner is not None:
            spinner.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
