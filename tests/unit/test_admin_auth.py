"""Admin routes (/update_weights_from_disk, /start_profile, /stop_profile, /flush_cache,
/abort_request): --admin-api-key, else --api-key; with neither, only on a loopback --host (403
and a start-up warning otherwise); the paths they take confined to folders named at start-up.

Against the app of http_server.build_app with a stub tokenizer manager: nothing is served.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from radixlm.runtime.config import ServerArgs
from radixlm.server.admin_api import ADMIN_PATHS
from radixlm.server.http_server import build_app

ADMIN_CALLS = [("post", "/update_weights_from_disk", {}), ("post", "/start_profile", {}),
               ("post", "/stop_profile", None), ("post", "/flush_cache", None),
               ("post", "/abort_request", {"rid": "r1"})]


class _StubTM(SimpleNamespace):
    def __init__(self, model_path):
        super().__init__(server_args=ServerArgs(), chat_template=None, tokenizer=None,
                         metrics=None, model_name="stub", context_len=1024,
                         model_path=model_path, weight_version="default",
                         info={"max_total_tokens": 1, "device": "cpu", "dtype": "float32",
                               "eos_token_ids": [0]}, calls=[])

    async def control(self, kind, payload=None, timeout=None):
        self.calls.append((kind, payload))
        return {"start_profile": "/trace", "stop_profile": "/trace", "flush_cache": True,
                "get_stats": {}}.get(kind)

    async def abort_request(self, rid):
        self.calls.append(("abort", rid))

    async def update_weights_from_disk(self, body):
        self.calls.append(("update", body))
        return {"success": True, "message": "ok", "num_paused_requests": 0}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "models" / "m1"
    d.mkdir(parents=True)
    return d


def client(model_dir, **kw):
    tm = _StubTM(str(model_dir))
    c = TestClient(build_app(tm, ServerArgs(**kw), lambda: None))
    c.tm = tm
    return c


def call(c, method, path, body, headers=None):
    return getattr(c, method)(path, json=body, headers=headers or {})


def msg(r) -> str:
    j = r.json()
    return j["message"] if "message" in j else j["error"]["message"]


def test_every_admin_route_is_guarded():
    assert {p for _, p, _ in ADMIN_CALLS} == set(ADMIN_PATHS)


@pytest.mark.parametrize("method,path,body", ADMIN_CALLS)
def test_admin_key_required_on_admin_routes(model_dir, method, path, body):
    c = client(model_dir, api_key="user", admin_api_key="admin")
    for headers in ({}, {"Authorization": "Bearer user"}, {"x-api-key": "user"},
                    {"Authorization": "Bearer wrong"}):
        r = call(c, method, path, body, headers)
        assert r.status_code == 401 and "API key" in msg(r), (headers, r.text)
    assert c.tm.calls == []
    assert call(c, method, path, body, {"Authorization": "Bearer admin"}).status_code == 200
    assert call(c, method, path, body, {"x-api-key": "admin"}).status_code == 200


def test_ordinary_routes_keep_the_api_key(model_dir):
    c = client(model_dir, api_key="user", admin_api_key="admin")
    assert c.get("/get_model_info").status_code == 401
    assert c.get("/get_model_info", headers={"Authorization": "Bearer admin"}).status_code == 401
    assert c.get("/get_model_info", headers={"Authorization": "Bearer user"}).status_code == 200
    assert c.get("/health").status_code == 200


def test_admin_key_alone_leaves_ordinary_routes_open(model_dir):
    c = client(model_dir, admin_api_key="admin", host="0.0.0.0")
    assert c.get("/get_model_info").status_code == 200
    assert c.post("/flush_cache").status_code == 401
    assert c.post("/flush_cache", headers={"Authorization": "Bearer admin"}).status_code == 200


@pytest.mark.parametrize("method,path,body", ADMIN_CALLS)
def test_api_key_serves_admin_routes_without_admin_key(model_dir, method, path, body):
    c = client(model_dir, api_key="user", host="0.0.0.0")
    assert call(c, method, path, body).status_code == 401
    assert call(c, method, path, body, {"Authorization": "Bearer user"}).status_code == 200


def test_server_info_hides_both_keys(model_dir):
    c = client(model_dir, api_key="user-secret", admin_api_key="admin-secret")
    r = c.get("/get_server_info", headers={"Authorization": "Bearer user-secret"})
    assert r.status_code == 200
    assert "admin-secret" not in r.text and "admin_api_key" not in r.json()


@pytest.mark.parametrize("method,path,body", ADMIN_CALLS)
def test_no_key_non_loopback_answers_403(model_dir, method, path, body):
    c = client(model_dir, host="0.0.0.0")
    r = call(c, method, path, body)
    assert r.status_code == 403 and "--admin-api-key" in msg(r)
    assert c.tm.calls == []
    assert c.get("/get_model_info").status_code == 200  # ordinary routes stay open


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_no_key_loopback_serves_admin_routes(model_dir, host, caplog):
    with caplog.at_level(logging.WARNING, logger="radixlm.server.http_server"):
        c = client(model_dir, host=host)
    assert not [r for r in caplog.records if "admin" in r.getMessage()]
    assert c.post("/flush_cache").status_code == 200


def test_no_key_non_loopback_warns_once_at_start_up(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="radixlm.server.http_server"):
        client(model_dir, host="0.0.0.0")
    warned = [r for r in caplog.records if "--admin-api-key" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radixlm.server.http_server"):
        client(model_dir, host="0.0.0.0", admin_api_key="admin")
    assert not caplog.records


def test_update_weights_confined_to_the_model_folder(model_dir, tmp_path):
    c = client(model_dir)
    inside = model_dir / "ckpt-2"
    inside.mkdir()
    assert c.post("/update_weights_from_disk", json={"model_path": str(inside)}).status_code == 200
    assert c.post("/update_weights_from_disk",
                  json={"model_path": str(model_dir)}).status_code == 200
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    sneaky = model_dir / "link"
    os.symlink(outside, sneaky)  # inside by name, outside once resolved
    for p in (str(outside), str(sneaky), str(model_dir) + "/../m1-evil", str(model_dir) + "-x",
              "/etc"):
        r = c.post("/update_weights_from_disk", json={"model_path": p})
        assert r.status_code == 400, p
        assert msg(r).startswith("model_path:") and not r.json()["success"]
    assert [k for k, _ in c.tm.calls] == ["update", "update"]


def test_update_weights_allowed_dirs_flag(model_dir, tmp_path):
    other = tmp_path / "ckpts"
    other.mkdir()
    c = client(model_dir, update_weights_allowed_dirs=f"{tmp_path / 'nope'}, {other}")
    assert c.post("/update_weights_from_disk", json={"model_path": str(other)}).status_code == 200
    r = c.post("/update_weights_from_disk", json={"model_path": str(model_dir)})
    assert r.status_code == 400 and "--update-weights-allowed-dirs" in msg(r)


def test_gguf_model_allows_its_folder(model_dir):
    gguf = model_dir / "m.gguf"
    gguf.write_bytes(b"")
    c = client(gguf)
    assert c.post("/update_weights_from_disk",
                  json={"model_path": str(model_dir / "n.gguf")}).status_code == 200


def test_profile_output_dir_confined(model_dir, tmp_path, monkeypatch):
    traces = tmp_path / "traces"
    traces.mkdir()
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(traces))
    c = client(model_dir)
    assert c.post("/start_profile", json={"output_dir": str(traces / "run1")}).status_code == 200
    for body in ({"output_dir": str(model_dir)}, {"output_dir": "/etc"},
                 {"output_dir": str(traces) + "/../x"}):
        r = c.post("/start_profile", json=body)
        assert r.status_code == 400 and msg(r).startswith("output_dir:"), body
    for k in ("profile_id", "profile_prefix"):
        r = c.post("/start_profile", json={k: "../../etc/x"})
        assert r.status_code == 400 and msg(r).startswith(k)
    assert [k for k, _ in c.tm.calls] == ["start_profile"]
    c2 = client(model_dir, profile_allowed_dirs=str(model_dir))
    assert c2.post("/start_profile", json={"output_dir": str(model_dir)}).status_code == 200
    r = c2.post("/start_profile", json={"output_dir": str(traces)})
    assert r.status_code == 400 and "--profile-allowed-dirs" in msg(r)


def router_client(**kw):
    from radixlm.router.app import Router
    from radixlm.router.app import build_app as build_router_app
    from radixlm.router.args import RouterArgs

    return TestClient(build_router_app(Router(RouterArgs(**kw))))


def test_router_guards_admin_and_pool_routes(caplog):
    with caplog.at_level(logging.WARNING, logger="radixlm.router"):
        c = router_client(host="0.0.0.0", worker_startup_timeout_secs=1.0)  # unguarded: fails fast
    assert len([r for r in caplog.records if "--admin-api-key" in r.getMessage()]) == 1
    for path in ("/add_worker?url=http://127.0.0.1:1", "/remove_worker?url=x", "/flush_cache"):
        r = c.post(path)
        assert r.status_code == 403 and "--admin-api-key" in msg(r), path
    c = router_client(host="0.0.0.0", api_key="user", admin_api_key="admin")
    for headers in ({}, {"Authorization": "Bearer user"}):
        assert c.post("/remove_worker?url=x", headers=headers).status_code == 401
    # past the guard: the pool answers (the url is no worker of it)
    r = c.post("/remove_worker?url=x", headers={"Authorization": "Bearer admin"})
    assert r.status_code not in (401, 403)
    assert c.get("/list_workers", headers={"Authorization": "Bearer admin"}).status_code == 401
    assert c.get("/list_workers", headers={"Authorization": "Bearer user"}).status_code == 200
