"""Which disaggregation settings can run, checked before any process starts (no torch here:
the launcher imports it)."""

from __future__ import annotations

MODES = ("prefill", "decode")
BACKENDS = ("gloo", "nccl")  # SGLang's mooncake / nixl / ascend / mori need their RDMA engines


def check_disaggregation_args(args):
    """`args` with --disaggregation-mode "null" read as colocated; ValueError naming the flag
    for a combination this server cannot run."""
    mode = args.disaggregation_mode
    if mode in ("null", "none", ""):
        return args.replace(disaggregation_mode=None)
    if mode is None:
        return args
    if mode not in MODES:
        raise ValueError(f"--disaggregation-mode: {mode!r} is not one of prefill, decode, null")
    backend = args.disaggregation_transfer_backend
    if backend not in BACKENDS:
        raise ValueError(f"--disaggregation-transfer-backend: {backend!r} is not available here; "
                         f"this server moves KV with {' or '.join(BACKENDS)} (torch.distributed "
                         f"send/recv; nccl needs CUDA)")
    if backend == "nccl" and args.device == "cpu":
        raise ValueError("--disaggregation-transfer-backend nccl needs CUDA; use gloo on the CPU")
    port = args.disaggregation_bootstrap_port
    if not 0 < port < 65536:
        raise ValueError(f"--disaggregation-bootstrap-port: {port} is not a TCP port")
    if mode == "prefill" and port == args.port:
        raise ValueError("--disaggregation-bootstrap-port: the same port as --port")
    if mode == "decode" and args.disable_radix_cache:
        raise ValueError("--disaggregation-mode decode needs the radix cache: received KV is "
                         "inserted into it (drop --disable-radix-cache)")
    if args.disaggregation_timeout <= 0:
        raise ValueError("--disaggregation-timeout: must be > 0 seconds")
    for flag, bad in (("--tp-size", args.tp_size > 1), ("--dp-size", args.dp_size > 1),
                      ("--enable-hierarchical-cache", args.enable_hierarchical_cache),
                      ("--speculative-algorithm", args.speculative_algorithm is not None)):
        if bad:
            raise ValueError(f"--disaggregation-mode {mode} does not run with {flag} yet "
                             f"(one scheduler per server, one device pool)")
    return args
