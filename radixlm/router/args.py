"""The router's configuration: one frozen dataclass, one CLI flag per field.

Flag names and defaults are sgl-router's (`python -m sglang_router.launch_router`): --worker-urls,
--policy, --cache-threshold 0.3, --balance-abs-threshold 64, --balance-rel-threshold 1.5 (the
SGLang model gateway's current defaults; older sgl-router releases had 0.5 / 32 / 1.0001),
--max-tree-size, --health-check-interval-secs, --health-failure-threshold,
--worker-startup-timeout-secs, --request-timeout-secs. `--load-balance-method` (SGLang's
server flag) is accepted as another name of --policy. One difference: --max-tree-size counts the
characters kept per worker (sgl-router counts nodes), and the bound holds after every insert,
so there is no --eviction-interval.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional

from radixlm.router.policy import POLICIES

# How dp.py hands a replica (`python -m radixlm.router.replica`) its start: its ServerArgs as
# JSON, and the launcher's pid, which the replica must not outlive.
ARGS_ENV = "RADIXLM_REPLICA_ARGS"
PARENT_ENV = "RADIXLM_REPLICA_PARENT"


@dataclass(frozen=True)
class RouterArgs:
    worker_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 24
    health_check_interval_secs: float = 5.0
    health_check_timeout_secs: float = 5.0
    health_failure_threshold: int = 3
    worker_startup_timeout_secs: float = 600.0
    request_timeout_secs: float = 1800.0  # the longest wait for a worker's next bytes
    retry_max_retries: int = 2  # other workers tried when a worker's connection fails
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None  # admin routes: this key, else api_key (server's rule)
    max_payload_size: int = 32 * 1024 * 1024
    timeout_graceful_shutdown: float = 30.0
    log_level: str = "warning"
    # prefill/decode disaggregation (router/pd.py): ((url, bootstrap port or None), ...), (url, ...)
    pd_disaggregation: bool = False
    prefill: tuple = ()
    decode: tuple = ()

    def replace(self, **kw) -> "RouterArgs":
        return dataclasses.replace(self, **kw)


_HELP = {
    "pd_disaggregation": "prefill/decode disaggregation: each /generate goes to a --prefill "
                         "server (its prompt's KV) and a --decode server (the output)",
    "prefill": "a prefill server (--disaggregation-mode prefill) and, optionally, its "
               "--disaggregation-bootstrap-port (default: read from its /get_server_info)",
    "decode": "a decode server (--disaggregation-mode decode); several URLs or repeated",
    "worker_urls": "the workers' base URLs (http://host:port); more join through /add_worker",
    "policy": "load-balancing policy: " + " | ".join(POLICIES),
    "cache_threshold": "cache_aware: route by prefix when matched characters / prompt > this",
    "balance_abs_threshold": "cache_aware: imbalanced when max - min in-flight > this ...",
    "balance_rel_threshold": "... and max in-flight > min * this: then the least loaded",
    "max_tree_size": "cache_aware: characters remembered per worker (LRU beyond)",
    "health_failure_threshold": "consecutive failed /health checks before a worker is removed "
                                "(a refused connection removes it at once)",
    "retry_max_retries": "a request whose worker's connection failed before anything was sent "
                         "back is retried on up to this many other workers",
    "api_key": "require 'Authorization: Bearer KEY' (or x-api-key) except on /health; the "
               "header is forwarded to the workers",
    "admin_api_key": "the key /add_worker, /remove_worker and the workers' admin routes "
                     "(/flush_cache, /update_weights_from_disk, ...) require instead of "
                     "--api-key; with neither key set they answer only on a loopback --host",
}


def _kind(f: dataclasses.Field):
    ann = str(f.type)
    for name, typ in (("int", int), ("float", float)):
        if ann == name:
            return typ
    return str


def build_parser(prog: str = "radixlm router") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="A cache-aware router in front of radixlm "
                                                       "(or SGLang) servers.")
    for f in dataclasses.fields(RouterArgs):
        flags = ["--" + f.name.replace("_", "-")]
        if f.name == "worker_urls":
            p.add_argument(*flags, nargs="+", default=[], help=_HELP[f.name])
            continue
        if f.name == "pd_disaggregation":
            p.add_argument(*flags, action="store_true", help=_HELP[f.name])
            continue
        if f.name in ("prefill", "decode"):
            p.add_argument(*flags, action="append", nargs="+", default=[],
                           metavar="URL" if f.name == "decode" else "URL [BOOTSTRAP_PORT]",
                           help=_HELP[f.name])
            continue
        if f.name == "policy":
            flags.append("--load-balance-method")
        p.add_argument(*flags, dest=f.name, type=_kind(f), default=f.default,
                       choices=POLICIES if f.name == "policy" else None,
                       help=_HELP.get(f.name, f"default: {f.default}"))
    return p


def parse_router_args(argv=None) -> RouterArgs:
    ns = build_parser().parse_args(argv)
    d = vars(ns)
    d["worker_urls"] = tuple(d["worker_urls"])
    d["prefill"], d["decode"] = _pd_workers(d["prefill"], d["decode"])
    if (d["prefill"] or d["decode"]) and not d["pd_disaggregation"]:
        raise SystemExit("radixlm router: --prefill / --decode need --pd-disaggregation")
    return RouterArgs(**d)


def _pd_workers(prefill: list[list[str]], decode: list[list[str]]):
    """`--prefill URL [PORT]` (each time) -> ((url, port or None), ...); `--decode URL...`."""
    out = []
    for group in prefill:
        i = 0
        while i < len(group):
            url, port = group[i], None
            if i + 1 < len(group) and group[i + 1].isdigit():
                port, i = int(group[i + 1]), i + 1
            out.append((url, port))
            i += 1
    return tuple(out), tuple(u for group in decode for u in group)
