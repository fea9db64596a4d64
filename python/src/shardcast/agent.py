"""The local transferd's admin API: hand-offs and model status (``shardcast.Agent``)."""

import os
import pathlib
import time
import urllib.parse
from dataclasses import dataclass, field

from . import errors
from ._transport import Endpoint

ENV_ADMIN = "SHARDCAST_ADMIN"
ENV_ADMIN_SOCKET = "SHARDCAST_ADMIN_SOCKET"
DEFAULT_ADMIN = "https://127.0.0.1:7402"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a hand-off: where it sits in the model's region."""

    name: str
    dtype: str
    shape: tuple
    offset: int  # bytes from the start of the region
    nbytes: int
    shard: str  # the shard (file in the model) it came from


@dataclass(frozen=True)
class ShardInfo:
    """One shard: its path in the model, the memory-tier file holding it ("" when the host
    does not say), and where it sits in the region."""

    path: str
    file: str
    offset: int
    size: int


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU holding the model: the region's CUDA IPC handle (``kind == "cuda-ipc"``) or,
    for simulated GPUs, its backing file (``kind == "simulated-file"``)."""

    gpu: int
    device_kind: str
    name: str
    handle: dict
    size: int


@dataclass
class Handoff:
    """A model's hand-off, as transferd's ``GET /v1/handoff/{model}`` gives it.

    ``kind`` is ``cuda-ipc`` (resident on real GPUs), ``simulated`` (simulated GPUs: each
    region is a file) or ``memory-file`` (the memory-tier shard files). ``tensors`` maps a
    name to its :class:`TensorInfo`; ``shards`` lists the shards that hold them.
    """

    model: str
    name: str
    kind: str
    devices: list
    shards: list
    tensors: dict
    partition: str = None
    raw: dict = field(default=None, repr=False)

    @classmethod
    def from_json(cls, doc):
        tensors = {}
        for t in doc.get("tensors", []):
            tensors[t["name"]] = TensorInfo(t["name"], t["dtype"], tuple(t["shape"]), int(t["offset"]),
                                            int(t["nbytes"]), t.get("shard", ""))
        return cls(
            model=doc.get("model", ""),
            name=doc.get("name", ""),
            kind=doc.get("kind", ""),
            devices=[DeviceInfo(int(d["gpu"]), d.get("device_kind", ""), d.get("name", ""), d.get("handle", {}),
                                int(d.get("size", 0))) for d in doc.get("devices", [])],
            shards=[ShardInfo(s["path"], s.get("file", ""), int(s["offset"]), int(s["size"]))
                    for s in doc.get("shards", [])],
            tensors=tensors,
            partition=doc.get("partition"),
            raw=doc,
        )

    @property
    def gpus(self):
        """GPU indices holding the model (empty for a memory-tier hand-off)."""
        return [d.gpu for d in self.devices]

    def shard(self, path):
        for s in self.shards:
            if s.path == path:
                return s
        raise KeyError(f"the hand-off of {self.name} lists no shard {path!r}")

    @property
    def nbytes(self):
        return sum(t.nbytes for t in self.tensors.values())


class Agent:
    """Client of the transferd on this host (its admin listener).

    ``address``: ``https://127.0.0.1:7402`` (default; ``SHARDCAST_ADMIN``), or
    ``unix:/run/shardcast/admin.sock`` (``SHARDCAST_ADMIN_SOCKET`` holds a socket path).
    Over HTTPS the daemon's certificate is checked against ``ca`` (``SHARDCAST_TLS_CA``) and
    the caller shows a client certificate (``cert``/``key``, ``SHARDCAST_TLS_CERT``/``_KEY``,
    role ``read`` or above) or a bearer token (``token``, ``token_file``,
    ``SHARDCAST_TOKEN``, ``SHARDCAST_TOKEN_FILE``). On the socket the daemon trusts the
    caller's uid (its own user, root, or the ``store_group``).
    """

    def __init__(self, address=None, *, ca=None, cert=None, key=None, token=None, token_file=None,
                 timeout=30.0):
        if address is None:
            sock = os.environ.get(ENV_ADMIN_SOCKET)
            address = f"unix:{sock}" if sock else os.environ.get(ENV_ADMIN, DEFAULT_ADMIN)
        elif address.startswith("/"):
            address = "unix:" + address
        self._ep = Endpoint(address, ca=ca, cert=cert, key=key, token=token, token_file=token_file,
                            timeout=timeout, unavailable=errors.DaemonUnavailable, what="transferd")
        self.address = address

    def __repr__(self):
        return f"shardcast.Agent({self.address!r})"

    def healthy(self):
        """Whether the daemon answers ``/healthz`` (no identity needed)."""
        try:
            self._ep.call("GET", "/healthz")
            return True
        except errors.Unavailable:
            return False

    def handoff(self, model, tensors=None, prefixes=None):
        """The hand-off of ``model`` (name or hex digest) as a :class:`Handoff`.

        ``tensors`` (names) and ``prefixes`` ask the daemon for those tensors only (a
        tensor-parallel rank's, say): the answer lists only them and the shards that hold
        them, and on the memory tier the daemon re-checks only their chunks.

        Raises :class:`UnknownModel` (the host does not know the model), :class:`NotReady`
        (loading, incomplete, being repaired), :class:`InvalidRequest` (a tensor the model
        lacks), :class:`Unauthorized`, :class:`DaemonUnavailable`.
        """
        query = []
        if tensors:
            query.append(("tensors", ",".join(tensors)))
        for p in prefixes or ():
            query.append(("prefix", p))
        doc = self._ep.call("GET", "/v1/handoff/" + urllib.parse.quote(model, safe=""), query=query or None,
                            not_found=errors.UnknownModel)
        return Handoff.from_json(doc)

    def wait_ready(self, model, timeout=300.0, interval=0.2, **kw):
        """Polls :meth:`handoff` until the model can be handed off (not :class:`NotReady`);
        returns the hand-off. An unknown model is retried too until ``timeout`` (a prewarm
        may not have reached this host yet), then raised."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.handoff(model, **kw)
            except (errors.NotReady, errors.UnknownModel):
                if time.monotonic() >= deadline:
                    raise
            time.sleep(interval)

    def model_status(self, model):
        """What this host can hand off of ``model``: a dict with ``state`` (``gpu``: resident
        on GPUs, ``memory``: complete in the memory tier, ``not-ready`` with ``message``),
        ``kind``, ``gpus``, ``tensors``, ``bytes``, ``digest``, ``name`` and ``partition``.
        Raises :class:`UnknownModel` when the host does not know it."""
        try:
            h = self.handoff(model)
        except errors.NotReady as e:
            return {"state": "not-ready", "message": e.message, "model": model}
        return {
            "state": "memory" if h.kind == "memory-file" else "gpu",
            "kind": h.kind,
            "gpus": h.gpus,
            "tensors": len(h.tensors),
            "bytes": h.nbytes,
            "digest": h.model,
            "name": h.name,
            "partition": h.partition,
        }

    def files(self, model):
        """``{path in the model: memory-tier file}`` for every shard the hand-off names with a
        file (weights, configs, tokenizer files)."""
        return {s.path: s.file for s in self.handoff(model).shards if s.file}

    def metrics(self):
        """The daemon's ``/metrics`` page (Prometheus text)."""
        return self._ep.call("GET", "/metrics")

    def metric_values(self):
        """``{"name{labels}": value}`` parsed from :meth:`metrics`."""
        out = {}
        for line in self.metrics().splitlines():
            if not line or line.startswith("#"):
                continue
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                pass
        return out


def link_model_dir(model, dest, agent=None):
    """Makes ``dest`` a directory of symlinks to the memory-tier files of ``model`` (weights,
    ``config.json``, tokenizer files), for engines that load a model from a directory
    (vLLM ``--model``, SGLang ``--model-path``, TGI ``--model-id``): they then mmap the
    files that transferd holds in host memory — no copy to disk, nothing downloaded.
    Returns ``dest`` as a ``pathlib.Path``. The process needs read access to the memory tier (transferd's
    ``store_group``)."""
    agent = agent or Agent()
    files = agent.files(model)
    if not files:
        raise errors.NotReady(f"the hand-off of {model} names no memory-tier files")
    dest = os.fspath(dest)
    os.makedirs(dest, exist_ok=True)
    for path, file in files.items():
        link = os.path.join(dest, path)
        if os.path.relpath(link, dest).startswith(".."):
            raise errors.ShardcastError(f"shard path {path!r} leaves {dest}")
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(file, link)
    return pathlib.Path(dest)
