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
