"""A vLLM model loader that takes the weights from the local transferd.

Registered under the load format ``shardcast`` (``vllm serve MODEL_DIR --load-format
shardcast``) by vLLM's general-plugin entry point (``vllm.general_plugins`` in this package's
metadata), or by calling :func:`register` before the engine starts. It is written against
vLLM's documented model-loader interface: a ``BaseModelLoader`` subclass with
``download_model(model_config)`` and ``load_weights(model, model_config)``, registered with
``vllm.model_executor.model_loader.register_model_loader``. vLLM is imported only inside
:func:`register`; :func:`weights_iterator` needs nothing of it.

Configuration (``--model-loader-extra-config '{"model": "org/llama-3-8b", ...}'``, else the
environment): ``model`` (the name transferd knows; default: ``model_config.model``),
``admin`` (``SHARDCAST_ADMIN`` / ``SHARDCAST_ADMIN_SOCKET``), ``ca``, ``cert``, ``key``,
``token``, ``token_file`` (as :class:`shardcast.Agent`), ``wait_s`` (how long
``download_model`` waits for the model to be ready on this host, default 600), and
``prewarm`` (``true``: ask the controller, ``SHARDCAST_CONTROLLER_URL``, to bring the model to
this host's memory tier first).

Tensor parallelism: vLLM's own weight loaders narrow each tensor to the rank's part, so the
iterator yields whole tensors — views of the held memory, of which only the rank's part is
ever touched (for GPU-resident models: views of the daemon's GPU memory on the rank's GPU,
copied device to device into the parameters).
"""

import logging
import os
import socket

from . import errors
from .agent import Agent
from .reader import SafeOpen

LOAD_FORMAT = "shardcast"
log = logging.getLogger("shardcast.vllm")


def weights_iterator(model, *, agent=None, framework="pt", device="auto", tensors=None, prefixes=None,
                     handoff=None):
    """Yields ``(name, tensor)`` for every tensor of ``model`` held by the local transferd, in
    region order (sequential reads). ``device="auto"``: the current CUDA device when the
    model is resident there (CUDA IPC views), else CPU views of the memory tier."""
    agent = agent or Agent()
    if device == "auto":
        device = "cpu"
        if framework == "pt":
            try:
                import torch

                if torch.cuda.is_available():
                    h = handoff or agent.handoff(model, tensors=tensors, prefixes=prefixes)
                    handoff = h
                    here = torch.cuda.current_device()
                    if h.kind == "cuda-ipc" and here in h.gpus:
                        device = f"cuda:{here}"
            except ImportError:
                pass
    f = SafeOpen(model, framework, device, agent=agent, tensors=tensors, prefixes=prefixes, handoff=handoff)
    try:
        for name in f.offset_keys():
            yield name, f.get_tensor(name)
    finally:
        f.close()


def _config(load_config):
    extra = dict(getattr(load_config, "model_loader_extra_config", None) or {})
    return extra


def _agent(cfg):
    address = cfg.get("admin")
    return Agent(address, ca=cfg.get("ca"), cert=cfg.get("cert"), key=cfg.get("key"), token=cfg.get("token"),
                 token_file=cfg.get("token_file"))


def _model_name(cfg, model_config):
    return cfg.get("model") or getattr(model_config, "model", None)


def _prewarm(name, cfg):
    from .client import Client

    c = Client(cfg.get("controller"), ca=cfg.get("ca"), cert=cfg.get("cert"), key=cfg.get("key"),
               token=cfg.get("token"), token_file=cfg.get("token_file"))
    host = cfg.get("host_id") or os.environ.get("SHARDCAST_HOST_ID") or socket.gethostname()
    plan = c.prewarm(name, hosts=[host], tier=cfg.get("tier", "memory"))
    c.wait(plan, timeout=float(cfg.get("wait_s", 600)))


def make_loader_class(base):
    """The loader class over vLLM's ``BaseModelLoader`` (``base``)."""

    class ShardcastModelLoader(base):
        """Loads weights handed off by the local transferd (``--load-format shardcast``)."""

        def __init__(self, load_config):
            super().__init__(load_config)
            self._cfg = _config(load_config)

        def download_model(self, model_config):
            name = _model_name(self._cfg, model_config)
            if str(self._cfg.get("prewarm", "")).lower() in ("1", "true", "yes"):
                _prewarm(name, self._cfg)
            _agent(self._cfg).wait_ready(name, timeout=float(self._cfg.get("wait_s", 600)))

        def load_weights(self, model, model_config):
            name = _model_name(self._cfg, model_config)
            agent = _agent(self._cfg)
            h = agent.wait_ready(name, timeout=float(self._cfg.get("wait_s", 600)))
            loaded = model.load_weights(weights_iterator(name, agent=agent, handoff=h))
            if loaded is not None:
                missing = {n for n, _ in model.named_parameters()} - set(loaded)
                if missing:
                    log.warning("shardcast: %d parameters were not in the hand-off of %s, e.g. %s",
                                len(missing), name, sorted(missing)[:5])
            log.info("shardcast: loaded %d tensors of %s (%s hand-off, %d bytes)", len(h.tensors), name, h.kind,
                     h.nbytes)

    return ShardcastModelLoader


_registered = {}


def register(load_format=LOAD_FORMAT):
    """Registers the loader with vLLM under ``load_format`` (idempotent) and returns the
    class. Also vLLM's general-plugin entry point, called in every vLLM process."""
    if load_format in _registered:
        return _registered[load_format]
    try:
        from vllm.model_executor.model_loader import BaseModelLoader, register_model_loader
    except ImportError as e:
        raise ImportError(
            "shardcast.vllm.register needs vLLM with register_model_loader "
            "(vllm.model_executor.model_loader); install vLLM, or use shardcast.safe_open / "
            "shardcast.vllm.weights_iterator directly") from e
    cls = make_loader_class(BaseModelLoader)
    register_model_loader(load_format)(cls)
    _registered[load_format] = cls
    return cls


__all__ = ["LOAD_FORMAT", "register", "weights_iterator", "make_loader_class", "errors"]
