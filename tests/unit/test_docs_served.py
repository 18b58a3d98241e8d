"""Docs that cannot drift: every route README.md and docs/*.md name is served, and every flag
they name is accepted.

Routes are read from the docs as backticked paths (`/v1/responses`) and as the paths of
`localhost:PORT/...` commands, and matched against the route table of the FastAPI apps, the
server's and the router's, built without serving (Starlette's own matcher: a path no route
matches is what would answer 404, a method no matching route takes 405). Flags (`--name`) must
appear in `radixlm serve --help` or `radixlm router --help`, or be defined by a benchmark
script (benchmarks/**/*.py) when the docs describe a benchmark's run. No server is started.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from starlette.routing import Match

from radixlm.router.app import Router
from radixlm.router.app import build_app as build_router_app
from radixlm.router.args import RouterArgs, build_parser
from radixlm.runtime.config import ServerArgs
from radixlm.server.cli_args import add_server_args
from radixlm.server.http_server import build_app as build_server_app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# backticked absolute paths that are files, not routes
_FILE_ROOTS = ("/tmp", "/home", "/usr", "/dev", "/etc", "/var", "/proc", "/opt", "/work")
_ROUTE_IN_TICKS = re.compile(r"`(/[A-Za-z_][\w/{}.:-]*)(?:\?[^`]*)?`")
_ROUTE_IN_COMMAND = re.compile(r"localhost:\d+(/[A-Za-z_][\w/{}.-]*)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]+)")


def documented_routes(texts: dict[str, str]) -> dict[str, str]:
    """route -> the first doc naming it."""
    out: dict[str, str] = {}
    for name, text in texts.items():
        for rx in (_ROUTE_IN_TICKS, _ROUTE_IN_COMMAND):
            for m in rx.finditer(text):
                path = m.group(1).rstrip(".:")
                if not path.startswith(_FILE_ROOTS):
                    out.setdefault(path, name)
    return out


def documented_flags(texts: dict[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, text in texts.items():
        for m in _FLAG.finditer(text):
            out.setdefault(m.group(1), name)
    return out


def _stub_tm() -> SimpleNamespace:
    """What registering the routes reads of a TokenizerManager (nothing is served)."""
    return SimpleNamespace(server_args=ServerArgs(), chat_template=None, tokenizer=None,
                           metrics=None, model_name="stub", context_len=1024)


def served_apps() -> list:
    router_app = build_router_app(Router(RouterArgs()))
    return [build_server_app(_stub_tm(), ServerArgs(), lambda: None), router_app]


def is_served(apps, path: str) -> bool:
    """Some route of some app takes `path` with some method (the router's catch-all forwarder,
    which takes any path, does not count)."""
    concrete = re.sub(r"\{[^}]*\}", "x", path)
    for app in apps:
        for route in app.routes:
            if getattr(route, "path", None) == "/{path:path}":
                continue
            for method in ("GET", "POST", "DELETE"):
                scope = {"type": "http", "path": concrete, "method": method}
                if route.matches(scope)[0] == Match.FULL:
                    return True
    return False


def help_texts() -> str:
    server = argparse.ArgumentParser(prog="radixlm serve")
    add_server_args(server)
    return server.format_help() + build_parser().format_help()


def benchmark_flags() -> set[str]:
    out = set()
    for p in ROOT.joinpath("benchmarks").rglob("*.py"):
        out.update(re.findall(r"""["'](--[a-z][a-z0-9-]+)["']""", p.read_text()))
    return out


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in DOCS}


@pytest.fixture(scope="module")
def apps():
    return served_apps()


def test_every_documented_route_is_served(texts, apps):
    routes = documented_routes(texts)
    assert "/v1/responses" in routes and "/generate" in routes  # the reader reads them
    missing = {r: doc for r, doc in routes.items() if not is_served(apps, r)}
    assert not missing, f"documented but not served (route: doc): {missing}"


def test_every_documented_flag_is_accepted(texts):
    flags = documented_flags(texts)
    assert "--max-stored-responses" in flags and "--metrics-names" in flags
    known = set(_FLAG.findall(help_texts())) | benchmark_flags() | {"--help"}
    missing = {f: doc for f, doc in flags.items() if f not in known}
    assert not missing, f"documented but in no --help (flag: doc): {missing}"


def test_the_check_fails_when_a_documented_route_goes(texts, apps):
    """Remove the Responses API's routes from a fresh app: the check names them."""
    server = served_apps()[0]
    server.router.routes[:] = [r for r in server.router.routes
                               if not getattr(r, "path", "").startswith("/v1/responses")]
    routes = documented_routes(texts)
    missing = [r for r in routes if not is_served([server, apps[1]], r)]
    assert "/v1/responses" in missing
    assert is_served(apps, "/v1/responses/{id}")  # the full app still has them
