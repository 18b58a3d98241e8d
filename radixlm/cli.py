"""The `radixlm` command: `radixlm serve [flags]`."""

from __future__ import annotations

import sys


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: radixlm serve [flags]   (radixlm serve --help lists the flags)")
        raise SystemExit(0 if argv else 2)
    if argv[0] != "serve":
        print(f"radixlm: unknown command {argv[0]!r}; try 'radixlm serve --help'", file=sys.stderr)
        raise SystemExit(2)
    from radixlm.server.cli_args import parse_server_args
    from radixlm.server.launch import launch_server

    launch_server(parse_server_args(argv[1:]))


if __name__ == "__main__":
    main()
