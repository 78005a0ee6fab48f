"""API errors and their wire shapes: OpenAI's `{"error": {message, type, param, code}}` and Anthropic's
`{"type": "error", "error": {type, message}}`. Every failure the ingress reports goes through here."""

from __future__ import annotations

import re
from http import HTTPStatus

import pydantic
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from engine.errors import EngineDeadError, EngineOverloadedError, RequestFailedError

# HTTP status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("service_unavailable", "overloaded_error"),
}


def _types(status: int) -> tuple[str, str]:
    return _TYPES.get(status) or _TYPES[400 if 400 <= status < 500 else 500]


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(status, message, param, code, retry_after_s)  # all in args: it pickles across Ray
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.message

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": _types(self.status)[0], "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": _types(self.status)[1], "message": self.message}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after_s)))} if self.retry_after_s is not None else {}


_PARAM_PREFIX = re.compile(r"^(?:Value error, )?([a-z_][a-z0-9_/]*(?:\.[A-Za-z0-9_\-]+)*): ")


def from_exception(e: BaseException) -> APIError:
    """The API error for any exception raised while serving a request."""
    cause = getattr(e, "cause", None)  # Ray re-raises a replica's exception wrapped, its message a traceback
    if isinstance(cause, BaseException):
        e = cause
    if isinstance(e, APIError):
        return e
    if isinstance(e, pydantic.ValidationError):
        return from_validation_errors(e.errors())
    if isinstance(e, EngineOverloadedError):
        return APIError(429, str(e), code="rate_limit_exceeded", retry_after_s=e.retry_after_s)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead", retry_after_s=5)
    if isinstance(e, BackPressureError):  # every engine replica's queue is full (AppArgs.max_queued_requests)
        return APIError(503, "the engine replicas' queues are full; retry later", code="overloaded", retry_after_s=1)
    if isinstance(e, (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)):
        # The replica died under this request (Ray replaces it); a retry goes to a live one.
        return APIError(503, f"the engine replica serving this request failed ({type(e).__name__}); retry",
                        code="replica_unavailable", retry_after_s=1)
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), code="request_failed")
    if isinstance(e, ValueError):
        message = str(e)
        match = _PARAM_PREFIX.match(message)
        code = "context_length_exceeded" if "max_model_len" in message else "invalid_value"
        return APIError(400, message, param=match.group(1) if match else None, code=code)
    return APIError(500, f"internal error: {type(e).__name__}", code="internal_error")


# What Starlette's own errors (no route, wrong method, a body it cannot read) become.
_HTTP_CODES = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}


def from_http_exception(status: int, detail: str, method: str, path: str) -> APIError:
    """The API error for an HTTPException of the framework (FastAPI/Starlette), raised before any route
    code runs: an unknown path, a method the path does not serve, a body that is not UTF-8."""
    message = f"malformed JSON body: {detail}" if status == 400 else f"{detail}: {method} {path}"
    return APIError(status, message, code=_HTTP_CODES.get(status))


def from_validation_errors(errors: list[dict]) -> APIError:
    """The first of pydantic's (or FastAPI's) validation errors, naming the field: from its location,
    or from the message of a model validator that names it ("min_tokens: ...")."""
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    message = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {message}", code="invalid_json")
    match = _PARAM_PREFIX.match(message)
    if match:
        return APIError(400, message, param=match.group(1), code="invalid_value")
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {message}", code="invalid_json")
    param = ".".join(loc)
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def status_phrase(status: int) -> str:
    return HTTPStatus(status).phrase
