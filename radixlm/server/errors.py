"""Errors of the HTTP layer and the two wire shapes they are answered in.

Every route turns an exception into an `APIError` (status, message, param, code) with
`to_api_error`, then renders it in the dialect of the API that was called:

    OpenAI:     {"error": {"message", "type", "param", "code"}}
    Anthropic:  {"type": "error", "error": {"type", "message"}}

Bad input must come back as a 4xx with a message a person can act on, never as a 500, so the
classification is explicit: pydantic validation errors and the `ValueError`s the TokenizerManager
raises before queueing are 400; a full queue or a runtime that is gone is 503; anything else is a
bug and is a logged 500.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)


class UnavailableError(Exception):
    """The server cannot serve the request now (503); the message says why."""


class QueueFullError(UnavailableError):
    """More requests are waiting than --max-queued-requests allows; the new one is refused (503)."""


class RuntimeGoneError(UnavailableError):
    """A process of the runtime (scheduler, detokenizer, a TP rank) died, or the server is
    stopping: the message names which. Raised for requests that arrive afterwards; the ones in
    flight end with `server_abort` (below)."""


def server_abort(message: str, status: int = 503) -> dict:
    """The finish_reason of a request the server tore down before it finished (SGLang's shape of
    a scheduler-initiated abort: `status_code` >= 500). Every route turns it into an error the
    client cannot mistake for a complete answer; a plain abort (/abort_request) stays a reason."""
    return {"type": "abort", "message": message, "status_code": status}


def server_fault(finish: Optional[dict]) -> Optional[tuple[int, str]]:
    """(status, message) when `finish` is a server-side teardown (see server_abort), else None."""
    if not finish or finish.get("type") != "abort":
        return None
    status = finish.get("status_code")
    if isinstance(status, int) and status >= 500:
        return status, finish.get("message") or "the request was aborted by the server"
    return None


class APIError(Exception):
    """An error with its HTTP status, ready to be rendered in either API's shape."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def to_api_error(exc: BaseException) -> APIError:
    """Classify any exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    # ValidationError subclasses ValueError, so it is tested first to keep its field location.
    if isinstance(exc, pydantic.ValidationError):
        first = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        # pydantic prefixes messages of validators that raised ValueError; the field says enough.
        msg = first.get("msg", "invalid value").removeprefix("Value error, ")
        text = f"{loc}: {msg}" if loc else msg
        if len(exc.errors()) > 1:
            text += f" (and {len(exc.errors()) - 1} more error(s))"
        return APIError(400, text, param=loc or None)
    if isinstance(exc, ValueError):
        return APIError(400, str(exc) or "invalid request")
    if isinstance(exc, UnavailableError):
        return APIError(503, str(exc) or "the server cannot take requests now; retry later")
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


# --- OpenAI -----------------------------------------------------------------------------------


def openai_error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def openai_error_body(message: str, err_type: str = "invalid_request_error",
                      param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def openai_error_response(exc: BaseException) -> JSONResponse:
    err = to_api_error(exc)
    body = openai_error_body(err.message, openai_error_type(err.status), err.param, err.code)
    return JSONResponse(body, status_code=err.status)


# --- Anthropic --------------------------------------------------------------------------------

# Anthropic names its error types after the status; 503 has no entry of its own there, and a
# full queue is what Anthropic calls being overloaded.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error", 529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(message: str, err_type: str = "invalid_request_error") -> dict:
    return {"type": "error", "error": {"type": err_type, "message": message}}


def anthropic_error_response(exc: BaseException) -> JSONResponse:
    err = to_api_error(exc)
    body = anthropic_error_body(err.message, anthropic_error_type(err.status))
    return JSONResponse(body, status_code=err.status)


# --- errors of the framework (no route, wrong method, a bug) ----------------------------------


def any_api_error_body(status: int, message: str) -> dict:
    """For errors raised before any route ran (unknown path, method not allowed) or by a bug:
    one body both SDKs read, whichever API the caller meant (Anthropic's `type: error` beside
    OpenAI's `error` object; each reads error.message)."""
    return {"type": "error", "error": {"message": message, "type": anthropic_error_type(status),
                                       "code": status}}


# --- request bodies ---------------------------------------------------------------------------


async def read_json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400: routes parse it themselves (not through FastAPI's
    body validation) so that every malformed body gets the caller's API error shape."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body
