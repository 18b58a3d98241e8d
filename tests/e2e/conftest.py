"""Fixtures of the end-to-end tests; the harness itself is in server_harness.py."""

from __future__ import annotations

from typing import Iterator

import pytest

from server_harness import MAIN_ARGS, ServerProcess, start_server, stop_and_check


@pytest.fixture(scope="session")
def main_server() -> Iterator[ServerProcess]:
    srv = start_server(MAIN_ARGS, name="main")
    yield srv
    stop_and_check(srv)


@pytest.fixture(scope="module")
def model_name(main_server) -> str:
    """The main server's served model name."""
    return main_server.get("/get_model_info").json()["served_model_name"]
