"""Exceptions raised by the shardcast client package.

Every exception derives from :class:`ShardcastError`, so ``except shardcast.ShardcastError``
catches them all; each also derives from the closest built-in (``LookupError``,
``ConnectionError``, ``PermissionError``, ``ValueError``) so generic handlers work too.
"""


class ShardcastError(Exception):
    """Base class. ``status`` is the HTTP status when there was one, ``code`` the API's error
    code (``NOT_FOUND``, ``PERMISSION_DENIED``, ...) when the answer carried one."""

    def __init__(self, message, *, status=None, code=None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


class UnknownModel(ShardcastError, LookupError):
    """The controller or the local transferd does not know the model (HTTP 404)."""


class NotFound(ShardcastError, LookupError):
    """Another unknown thing: a plan, a host, a route (HTTP 404)."""


class Unavailable(ShardcastError, ConnectionError):
    """The service could not be reached (connection refused, no socket, timeout, TLS
    failure on our side) or answered 503."""


class DaemonUnavailable(Unavailable):
    """The local transferd's admin listener cannot be reached: the daemon is not running,
    listens elsewhere, or its socket is missing."""


class ControllerUnavailable(Unavailable):
    """The controller's HTTP API cannot be reached or answered 503 (e.g. no live host)."""


class Unauthorized(ShardcastError, PermissionError):
    """The service refused the caller: no or an unknown bearer token, no client
    certificate or one of another CA (HTTP 401 or a TLS handshake refusal), or a role that
    lacks the permission (HTTP 403, e.g. a ``read`` token asking for a prewarm)."""


class InvalidRequest(ShardcastError, ValueError):
    """The request does not fit (HTTP 400): a malformed name, tier or replica count, or a
    hand-off selection naming tensors the model lacks."""


class NotReady(ShardcastError):
    """The model is known but cannot be handed off yet (HTTP 409): still loading onto GPUs,
    not complete in the memory tier, or a chunk found corrupt at rest is being repaired.
    Retry, or use :meth:`shardcast.Agent.wait_ready`."""


class PlanFailed(ShardcastError):
    """A plan the client waited for ended in state ``failed``; ``plan`` is its last status."""

    def __init__(self, message, plan):
        super().__init__(message)
        self.plan = plan


class PlanPartial(PlanFailed):
    """A plan the client waited for ended in state ``partial``: some requested hosts hold a
    verified copy, the others (``short``: their HostProgress dicts, each with ``state`` and
    ``error``) do not. A subclass of :class:`PlanFailed`, so code that only asks whether
    every replica arrived catches both; ``plan`` is the last status."""

    def __init__(self, message, plan, short):
        super().__init__(message, plan)
        self.short = short


class GpuUnavailable(ShardcastError, RuntimeError):
    """A CUDA device was asked for but this process has none (no PyTorch with CUDA, no
    driver, or no such device index)."""


class ApiError(ShardcastError):
    """Any other error answer (``status`` and ``code`` say which)."""
