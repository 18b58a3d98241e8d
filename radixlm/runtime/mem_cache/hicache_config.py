"""The hierarchical cache's settings (SGLang's flags) and the factory that builds the tree cache.

    --enable-hierarchical-cache (--enable-hicache)   L2 host pool (+ L3 with a storage backend)
    --hicache-ratio R        host pool = R x device pool tokens (SGLang: must come out larger)
    --hicache-size GB        host pool in GB (1e9 bytes), overrides the ratio when > 0
    --hicache-write-policy   write_through (default) | write_through_selective | write_back
    --hicache-storage-backend file
    --hicache-storage-prefetch-policy timeout (default) | best_effort | wait_complete
    --hicache-storage-backend-extra-config '{"file_storage_path": DIR, "file_storage_max_gb": G,
                                             "page_tokens": 64,
                                             "write_queue_pages": N, "prefetch_threshold": 256,
                                             "prefetch_timeout_base": 1,
                                             "prefetch_timeout_per_ki_token": 0.25,
                                             "prefetch_queue_pages": M}'
        DIR defaults to $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, then /tmp/hicache (SGLang's);
        G caps this model's pages in DIR (GB, 1e9 bytes; least recently used pages removed past
        it; default: none, writes stop when the disk is full);
        N bounds the pages queued for the writer thread (default: 1 GiB of pages, at most a
        quarter of the host pool; past it pages are dropped, not waited for); 0 writes them on
        the scheduler's thread; the prefetch keys are SGLang's (tokens, seconds, seconds per 1024
        tokens; see tier_prefetch.py), M bounds the pages being read into the host pool
        (default: 1 GiB of pages, at most half the host pool)
A bad value raises ValueError naming the field, before any pool is allocated.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Optional

from radixlm.runtime.mem_cache.radix_cache import RadixCache
from radixlm.runtime.mem_cache.storage import BACKENDS
from radixlm.runtime.mem_cache.storage.keys import file_fingerprint, namespace_seed
from radixlm.runtime.mem_cache.tier_prefetch import PREFETCH_POLICIES

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
DEFAULT_FILE_DIR = "/tmp/hicache"
DEFAULT_PAGE_TOKENS = 64
EXTRA_KEYS = ("file_storage_path", "file_storage_max_gb", "page_tokens", "write_queue_pages",
              "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
              "prefetch_queue_pages")


@dataclass(frozen=True)
class HiCacheConfig:
    host_capacity: int  # tokens
    write_policy: str
    storage_backend: Optional[str]
    storage_dir: Optional[str]
    page_tokens: int
    write_queue_pages: Optional[int] = None  # None: tier_writes.default_write_queue_pages
    prefetch_policy: str = "timeout"
    # TierPrefetch._init_prefetch's keywords from the extra config (None: its defaults)
    prefetch: tuple = ()
    storage_max_bytes: Optional[int] = None  # the file store's cap (None: the disk's size)

    @staticmethod
    def from_args(args, device_capacity: int, token_bytes: int) -> "HiCacheConfig":
        if args.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache: needs the radix cache "
                             "(drop --disable-radix-cache)")
        if args.tp_size != 1:
            raise ValueError("enable_hierarchical_cache: not supported with tp_size > 1 yet")
        if args.hicache_write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy: must be one of {WRITE_POLICIES} "
                             f"(got {args.hicache_write_policy!r})")
        size, ratio = args.hicache_size, args.hicache_ratio
        if not isinstance(size, (int, float)) or size < 0:
            raise ValueError(f"hicache_size: must be >= 0 GB (got {size!r})")
        if not isinstance(ratio, (int, float)) or ratio <= 0:
            raise ValueError(f"hicache_ratio: must be > 0 (got {ratio!r})")
        host = int(size * 1e9 // token_bytes) if size > 0 else int(device_capacity * ratio)
        if host <= device_capacity:
            field = "hicache_size" if size > 0 else "hicache_ratio"
            raise ValueError(f"{field}: the host pool ({host} tokens) must be larger than the "
                             f"device pool ({device_capacity} tokens)")
        backend, extra = args.hicache_storage_backend, _extra_config(args)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"hicache_storage_backend: must be one of {sorted(BACKENDS)} "
                             f"(got {backend!r})")
        page = extra.get("page_tokens", DEFAULT_PAGE_TOKENS)
        if isinstance(page, bool) or not isinstance(page, int) or page < 1:
            raise ValueError(f"hicache_storage_backend_extra_config: page_tokens must be a "
                             f"positive integer (got {page!r})")
        queue = extra.get("write_queue_pages")
        if queue is not None and (isinstance(queue, bool) or not isinstance(queue, int)
                                  or queue < 0):
            raise ValueError(f"hicache_storage_backend_extra_config: write_queue_pages must be "
                             f"an integer >= 0 (got {queue!r})")
        policy = getattr(args, "hicache_storage_prefetch_policy", "timeout")
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"hicache_storage_prefetch_policy: must be one of "
                             f"{PREFETCH_POLICIES} (got {policy!r})")
        prefetch = (("threshold", _number(extra, "prefetch_threshold", int)),
                    ("timeout_base", _number(extra, "prefetch_timeout_base", float)),
                    ("timeout_per_ki_token", _number(extra, "prefetch_timeout_per_ki_token",
                                                     float)),
                    ("queue_pages", _number(extra, "prefetch_queue_pages", int)))
        folder, max_gb = None, _number(extra, "file_storage_max_gb", float)
        if max_gb is not None and max_gb <= 0:
            raise ValueError(f"hicache_storage_backend_extra_config: file_storage_max_gb must be "
                             f"> 0 (got {max_gb!r})")
        if backend == "file":
            folder = (extra.get("file_storage_path") or os.environ.get(FILE_DIR_ENV)
                      or DEFAULT_FILE_DIR)
            if not isinstance(folder, str):
                raise ValueError("hicache_storage_backend_extra_config: file_storage_path must "
                                 f"be a string (got {folder!r})")
        max_bytes = None if max_gb is None else int(max_gb * 1e9)
        return HiCacheConfig(host, args.hicache_write_policy, backend, folder, page, queue,
                             policy, prefetch, max_bytes)


def _number(extra: dict, key: str, kind: type):
    """extra[key] as a number >= 0 of `kind` (int: an integer), or None when absent."""
    value = extra.get(key)
    if value is None:
        return None
    ok = (not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
          and value >= 0)
    if not ok:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"hicache_storage_backend_extra_config: {key} must be {what} >= 0 "
                         f"(got {value!r})")
    return kind(value)


def _extra_config(args) -> dict:
    raw = args.hicache_storage_backend_extra_config
    if raw is None or raw == "":
        return {}
    try:
        extra = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as e:
        raise ValueError(f"hicache_storage_backend_extra_config: not valid JSON ({e})") from None
    if not isinstance(extra, dict):
        raise ValueError("hicache_storage_backend_extra_config: must be a JSON object")
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"hicache_storage_backend_extra_config: unknown key(s) {unknown} "
                         f"(known: {list(EXTRA_KEYS)})")
    return extra


def model_fingerprint(runner) -> str:
    """What, besides the tokens, decides the KV bytes: the weights, and every setting that changes
    the arithmetic producing them (see storage/keys.py)."""
    path = runner.model_path
    if runner.load_format == "dummy":
        files = []  # random weights: the config and the seed below decide them
    elif os.path.isfile(path):
        files = [path]
    else:
        files = [f for ext in ("safetensors", "gguf", "bin", "pt")
                 for f in glob.glob(os.path.join(path, f"*.{ext}"))]
    numerics = (runner.load_format, runner.args.seed, runner.device.type,
                runner.attention_backend_name, runner.fp32_gemm, runner.keep_quantized,
                runner.gguf_dense_rows, repr(runner.fp8), runner.cpu_packed)
    config = json.dumps(runner.hf_config, sort_keys=True, default=str)
    return "|".join([file_fingerprint(files), repr(numerics), config])


def make_tree_cache(args, runner) -> RadixCache:
    """The scheduler's prefix cache: a RadixCache, or with --enable-hierarchical-cache the tiered
    HiRadixCache over the runner's device pool, a host pool and (optionally) a store."""
    if not args.enable_hierarchical_cache:
        return RadixCache(runner.allocator, runner.req_to_token_pool,
                          disable=args.disable_radix_cache)
    from radixlm.runtime.mem_cache.hiradix_cache import HiRadixCache
    from radixlm.runtime.mem_cache.host_pool import HostKVPool
    from radixlm.runtime.mem_cache.kv_mover import KVMover

    pool = runner.kv_pool
    heads, head_dim = pool.k_buffers[0].shape[1:]
    token_bytes = pool.bytes_per_token(pool.num_layers, heads, head_dim, pool.dtype)
    cfg = HiCacheConfig.from_args(args, runner.capacity, token_bytes)
    host = HostKVPool(cfg.host_capacity, pool, runner.device)
    mover = KVMover(pool, host, runner.device)
    seed, storage = open_storage(cfg, runner)
    cache = HiRadixCache(runner.allocator, runner.req_to_token_pool, host, mover,
                         cfg.write_policy, storage, seed, cfg.page_tokens,
                         write_queue_pages=cfg.write_queue_pages,
                         prefetch=dict(cfg.prefetch, policy=cfg.prefetch_policy))
    cache.config = cfg
    return cache


def open_storage(cfg: HiCacheConfig, runner) -> tuple[bytes, object]:
    """(key seed, store) for the runner's current weights; (b"", None) without a backend. The
    store's folder is named by the seed: each model and layout keeps its pages apart."""
    if cfg.storage_backend is None:
        return b"", None
    pool = runner.kv_pool
    heads, head_dim = pool.k_buffers[0].shape[1:]
    layout = (pool.num_layers, heads, head_dim, cfg.page_tokens, runner.tp.rank, runner.tp.size)
    seed = namespace_seed(model_fingerprint(runner), str(pool.dtype), layout)
    page_bytes = cfg.page_tokens * pool.bytes_per_token(pool.num_layers, heads, head_dim, pool.dtype)
    return seed, BACKENDS[cfg.storage_backend](cfg.storage_dir, seed.hex()[:16], page_bytes,
                                               max_bytes=cfg.storage_max_bytes)


def rekey_storage(cache, runner) -> None:
    """After new weights: pages are keyed by the new model from now on (the old ones stay on
    disk, under the old model's folder)."""
    if getattr(cache, "storage", None) is None:
        return
    cache.finish_writes(cancel=True)  # no page of the old weights lands after the switch
    cache.storage.close()
    cache.seed, cache.storage = open_storage(cache.config, runner)
    cache._key_memo.clear()
