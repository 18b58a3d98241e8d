"""The `radixlm` command: `radixlm serve [flags]` and `radixlm router [flags]`."""

from __future__ import annotations

import sys

USAGE = ("usage: radixlm serve [flags]    serve a model (radixlm serve --help lists the flags)\n"
         "       radixlm router [flags]   a cache-aware router in front of servers "
         "(radixlm router --help)")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    if argv[0] == "router":
        from radixlm.router.args import parse_router_args
        from radixlm.router.app import run_router

        run_router(parse_router_args(argv[1:]))
        return
    if argv[0] != "serve":
        print(f"radixlm: unknown command {argv[0]!r}; try 'radixlm serve --help'", file=sys.stderr)
        raise SystemExit(2)
    from radixlm.server.cli_args import parse_server_args
    from radixlm.server.launch import launch_server

    launch_server(parse_server_args(argv[1:]))


if __name__ == "__main__":
    main()
