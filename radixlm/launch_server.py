"""`python -m radixlm.launch_server [flags]`: serve a model (see `radixlm serve --help`)."""

from radixlm.server.cli_args import parse_server_args
from radixlm.server.launch import launch_server

if __name__ == "__main__":
    launch_server(parse_server_args())
