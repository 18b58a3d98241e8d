"""`python -m radixlm.router --worker-urls URL [URL ...]`: the standalone router."""

from radixlm.router.args import parse_router_args
from radixlm.router.app import run_router

if __name__ == "__main__":
    run_router(parse_router_args())
