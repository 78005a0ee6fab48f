"""Typed errors that cross the engine boundary; the serving layer maps them to HTTP statuses."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine hit a fatal error; every in-flight request failed and new ones are refused (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """This request alone failed (e.g. while sampling it); the engine goes on serving the others."""


class WorkerFailedError(RuntimeError):
    """A rank of a multi-device engine failed, died or hung: the engine cannot go on (fatal)."""
