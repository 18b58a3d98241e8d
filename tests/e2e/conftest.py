"""Fixtures of the end-to-end tests; the harness itself is in server_harness.py, the shared
`main_server` in tests/conftest.py (the SGLang compatibility check uses it too)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_name(main_server) -> str:
    """The main server's served model name."""
    return main_server.get("/get_model_info").json()["served_model_name"]
