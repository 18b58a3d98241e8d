"""Fuzz a running server's HTTP API from its own OpenAPI schema (schemathesis + hypothesis).

Every operation of /openapi.json (native, OpenAI, Anthropic, Responses, admin; or a router's)
gets requests generated from its schema: valid ones (positive) and ones that break it (negative:
wrong types, missing fields, bytes that are not JSON). Each answer is judged:
- `5xx`: any status >= 500, or a connection the server dropped (a bug: bad input is a 4xx, and
  a healthy server has no other cause);
- `hang`: no complete answer within --deadline seconds (streams are read to the end);
- `no_message`: an error status whose body is not JSON with an `error.message` (OpenAI, native,
  Anthropic shapes alike) or whose SSE stream carries an error event without a message.
Routes chain where they do: a created /v1/responses id is fed to GET/DELETE
/v1/responses/{response_id} and to later requests' previous_response_id.

Long run (prints one JSON line: requests, 5xx, hangs, per route):
    python -m benchmarks.probes.fuzz_api --url http://127.0.0.1:30000 --seconds 600
The short run in `make test` is tests/e2e/test_fuzz_api.py (bounded examples, fixed seed).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

# Paths a fuzzer must not call. /update_weights_from_disk: a valid call swaps the weights.
# /add_worker (router): the router would connect to whatever URL was generated, hosts off this
# machine included. /{path} (the router's catch-all): the workers' own operations, sent through
# the router (--schema-url), cover what it forwards.
SKIP_PATHS = {"/update_weights_from_disk", "/add_worker", "/{path}"}


@dataclass
class Report:
    requests: int = 0
    server_errors: int = 0
    hangs: int = 0
    no_message: int = 0
    routes: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    findings: list = field(default_factory=list)  # (kind, route, status, request, answer), first 50

    def add(self, route: str, status: Optional[int], problem: Optional[str], detail: dict) -> None:
        self.requests += 1
        r = self.routes[route]
        r["requests"] += 1
        r[str(status) if status is not None else "none"] += 1
        if problem is None:
            return
        r[problem] += 1
        self.server_errors += problem == "5xx"
        self.hangs += problem == "hang"
        self.no_message += problem == "no_message"
        if len(self.findings) < 50:
            self.findings.append({"problem": problem, "route": route, "status": status, **detail})

    def summary(self) -> dict:
        return {"requests": self.requests, "5xx": self.server_errors, "hangs": self.hangs,
                "no_message": self.no_message,
                "routes": {k: dict(v) for k, v in sorted(self.routes.items())}}


def _has_message(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and bool(err["message"])


def _sse_problem(text: str) -> Optional[str]:
    """An SSE body's error events must carry a message (data: {"error": {...}} or Anthropic's
    / Responses' event: error)."""
    for line in text.splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        try:
            data = json.loads(line[5:])
        except ValueError:
            return "no_message"
        if isinstance(data, dict) and ("error" in data or data.get("type") == "error"):
            ok = _has_message(data) or (data.get("type") == "error" and isinstance(
                data.get("message"), str))
            if not ok:
                return "no_message"
    return None


class Caller:
    """Sends one schemathesis case with httpx, reading the whole answer under a deadline."""

    def __init__(self, base_url: str, deadline_s: float, report: Report, headers: dict):
        self.base_url, self.deadline_s, self.report = base_url, deadline_s, report
        self.client = httpx.Client(timeout=deadline_s, headers=headers)
        self.response_ids: list[str] = []  # stored /v1/responses ids, for the chained routes

    def close(self) -> None:
        self.client.close()

    def prime(self) -> None:
        """Store one response, so that the chained routes get a real id from the start (a
        fuzzed body is seldom valid enough to create one)."""
        model = self.client.get(self.base_url + "/v1/models").json()["data"][0]["id"]
        r = self.client.post(self.base_url + "/v1/responses",
                             json={"model": model, "input": "Hi", "max_output_tokens": 4})
        self._learn_response_id(r)

    def chain(self, case, rnd: random.Random) -> None:
        """Feed ids of earlier answers into the case (the routes' state): half the time."""
        if not self.response_ids or rnd.random() < 0.5:
            return
        if "response_id" in (case.path_parameters or {}):
            case.path_parameters["response_id"] = rnd.choice(self.response_ids)
        elif case.path == "/v1/responses" and isinstance(case.body, dict):
            case.body["previous_response_id"] = rnd.choice(self.response_ids)

    def __call__(self, case) -> None:
        kw = case.as_transport_kwargs(base_url=self.base_url)
        route = f"{case.method.upper()} {case.path}"
        content = kw.get("data")
        if content is None and "json" in kw:
            content = json.dumps(kw["json"]).encode()
        headers = {k: v for k, v in kw.get("headers", {}).items()
                   if k.lower() not in ("user-agent", "connection")}
        request = {"method": kw["method"], "url": kw["url"][len(self.base_url):],
                   "params": kw.get("params"), "body": _short(content, 8000)}  # replayable
        t0 = time.monotonic()
        try:
            with self.client.stream(kw["method"], kw["url"], params=kw.get("params"),
                                    headers=headers, content=content) as r:
                chunks = []
                for chunk in r.iter_bytes():
                    chunks.append(chunk)
                    if time.monotonic() - t0 > self.deadline_s:
                        raise httpx.ReadTimeout("the answer is still streaming")
                raw = b"".join(chunks)
        except httpx.TimeoutException:
            self.report.add(route, None, "hang", {"request": request,
                                                  "seconds": round(time.monotonic() - t0, 1)})
            return
        except httpx.TransportError as e:  # the server closed the connection on us: a bug too
            self.report.add(route, None, "5xx", {"request": request, "answer": repr(e)})
            return
        self.report.add(route, r.status_code, self._problem(r, raw),
                        {"request": request, "answer": _short(raw)})
        if r.status_code == 200 and case.path == "/v1/responses" and case.method == "POST":
            self._learn_response_id(r)

    def _problem(self, r: httpx.Response, raw: bytes) -> Optional[str]:
        if r.status_code >= 500:
            return "5xx"
        ctype = r.headers.get("content-type", "")
        if r.status_code >= 400:
            try:
                return None if _has_message(json.loads(raw)) else "no_message"
            except ValueError:
                return "no_message"
        if ctype.startswith("text/event-stream"):
            return _sse_problem(raw.decode("utf-8", "replace"))
        return None

    def _learn_response_id(self, r: httpx.Response) -> None:
        rid = r.headers.get("x-radixlm-response-id")
        if rid and len(self.response_ids) < 64:
            self.response_ids.append(rid)


def _short(raw: Optional[bytes], n: int = 400) -> Optional[str]:
    if raw is None:
        return None
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return text if len(text) <= n else text[:n] + "..."


def operations(base_url: str, headers: Optional[dict] = None) -> list:
    """The schema's operations (those a fuzzer may call), from the server's /openapi.json."""
    import schemathesis

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json", headers=headers or {})
    ops = [res.ok() for res in schema.get_all_operations()]
    return [op for op in ops if op.path not in SKIP_PATHS]


def with_schemas(ops: list, urls: list[str], headers: dict) -> list:
    """`ops` plus the operations of other schemas (a router's workers': what it forwards),
    without duplicates (method and path)."""
    seen = {(op.method, op.path) for op in ops}
    for url in urls:
        for op in operations(url, headers):
            if (op.method, op.path) not in seen:
                seen.add((op.method, op.path))
                ops.append(op)
    return ops


def fuzz_round(ops: list, caller: Caller, examples: int, seed: int) -> None:
    """`examples` positive and `examples` negative cases per operation, from `seed`."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    rnd = random.Random(seed)
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=examples, deadline=None, database=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck),
                      print_blob=False)
            @hseed(seed)
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                caller.chain(case, rnd)
                caller(case)

            try:
                run()
            except Unsatisfiable:  # nothing to break: an operation without parameters
                pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--seconds", type=float, default=600.0, help="keep fuzzing this long")
    ap.add_argument("--examples", type=int, default=10, help="cases per operation and mode, "
                                                             "per round")
    ap.add_argument("--seed", type=int, default=0, help="the first round's; then +1 a round")
    ap.add_argument("--deadline", type=float, default=30.0, help="seconds before a hang")
    ap.add_argument("--schema-url", action="append", default=[],
                    help="also send this server's operations to --url (a router's worker)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--findings", default=None, help="write the findings (JSON) here")
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    ops = with_schemas(operations(args.url, headers), args.schema_url, headers)
    report = Report()
    caller = Caller(args.url, args.deadline, report, headers)
    caller.prime()
    t0, seed, rounds = time.monotonic(), args.seed, 0
    try:
        while time.monotonic() - t0 < args.seconds:
            fuzz_round(ops, caller, args.examples, seed)
            seed, rounds = seed + 1, rounds + 1
    finally:
        caller.close()
    out = {**report.summary(), "operations": len(ops), "rounds": rounds,
           "seconds": round(time.monotonic() - t0, 1)}
    if args.findings:
        with open(args.findings, "w") as f:
            json.dump(report.findings, f, indent=1)
    print(json.dumps(out))
    return 1 if report.server_errors or report.hangs or report.no_message else 0


if __name__ == "__main__":
    sys.exit(main())
