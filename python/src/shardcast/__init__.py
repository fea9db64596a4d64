"""shardcast: get model weights from the shardcast data plane into an inference engine.

* :class:`Client` — the controller's HTTP API: register, prewarm, scale out, status, watch.
* :class:`Agent` — the local transferd's admin API: hand-offs, model status.
* :func:`safe_open` — the ``safetensors.safe_open`` interface over a model the local
  transferd holds, without copying (memory tier mmap, or CUDA IPC on the GPU).
* :mod:`shardcast.vllm` — a vLLM model loader (``--load-format shardcast``).
"""

from .agent import Agent, Handoff, TensorInfo, link_model_dir
from .client import Client, plan_progress
from .errors import (
    ApiError,
    ControllerUnavailable,
    DaemonUnavailable,
    GpuUnavailable,
    InvalidRequest,
    NotFound,
    NotReady,
    PlanFailed,
    PlanPartial,
    ShardcastError,
    Unauthorized,
    Unavailable,
    UnknownModel,
)
from .reader import SafeOpen, safe_open

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "ApiError",
    "Client",
    "ControllerUnavailable",
    "DaemonUnavailable",
    "GpuUnavailable",
    "Handoff",
    "InvalidRequest",
    "NotFound",
    "NotReady",
    "PlanFailed",
    "PlanPartial",
    "SafeOpen",
    "ShardcastError",
    "TensorInfo",
    "Unauthorized",
    "Unavailable",
    "UnknownModel",
    "link_model_dir",
    "plan_progress",
    "safe_open",
]
