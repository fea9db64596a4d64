"""``shardcast.safe_open``: the ``safetensors.safe_open`` interface over a model held by the
local transferd, without copying its bytes.

* Memory tier (``kind == "memory-file"``) and simulated GPUs (``"simulated"``): each file is
  mapped once (``mmap``, copy-on-write: the daemon's files are never written) and tensors
  are ``numpy.frombuffer`` / ``torch.frombuffer`` views of the mapping; pages are read only
  when touched.
* GPU-resident models (``"cuda-ipc"``) with ``framework="pt"`` and ``device="cuda:N"`` on a
  GPU holding the model: the region is opened through its CUDA IPC handle and tensors are
  views of the daemon's GPU memory. Otherwise the memory-tier files are read and the tensor
  is moved with ``.to(device)``.
* Tensor parallelism: with ``tp_rank``/``tp_size``/``shard_dims`` every split tensor reads
  as the rank's part only (a view; for splits along dim 0 only the rank's rows are ever
  touched), and ``tensors=``/``prefixes=`` make the daemon hand off only what the rank uses.
"""

import json
import mmap
import os
import struct

from . import errors, tp
from .agent import Agent

# safetensors dtype -> (numpy dtype string or None, bytes per element, torch dtype name)
DTYPES = {
    "F64": ("<f8", 8, "float64"),
    "F32": ("<f4", 4, "float32"),
    "F16": ("<f2", 2, "float16"),
    "BF16": (None, 2, "bfloat16"),
    "I64": ("<i8", 8, "int64"),
    "I32": ("<i4", 4, "int32"),
    "I16": ("<i2", 2, "int16"),
    "I8": ("|i1", 1, "int8"),
    "U64": ("<u8", 8, "uint64"),
    "U32": ("<u4", 4, "uint32"),
    "U16": ("<u2", 2, "uint16"),
    "U8": ("|u1", 1, "uint8"),
    "BOOL": ("|b1", 1, "bool"),
    "F8_E4M3": (None, 1, "float8_e4m3fn"),
    "F8_E5M2": (None, 1, "float8_e5m2"),
}
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
FRAMEWORKS = {"numpy": "numpy", "np": "numpy", "pt": "pt", "torch": "pt", "pytorch": "pt"}


def _np_dtype(dtype):
    import numpy as np

    if dtype not in DTYPES:
        raise errors.ShardcastError(f"unsupported safetensors dtype {dtype}")
    s = DTYPES[dtype][0]
    if s is not None:
        return np.dtype(s)
    try:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, _ML_DTYPES[dtype]))
    except ImportError:
        raise TypeError(f"numpy has no {dtype}: install ml_dtypes, or use framework='pt'") from None


def _torch_dtype(torch, dtype):
    if dtype not in DTYPES:
        raise errors.ShardcastError(f"unsupported safetensors dtype {dtype}")
    t = getattr(torch, DTYPES[dtype][2], None)
    if t is None:
        raise TypeError(f"this PyTorch ({torch.__version__}) has no {DTYPES[dtype][2]}")
    return t


def _map(path):
    """A copy-on-write mapping of a whole file (nothing is read until touched; writes to the
    arrays stay private to this process)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except PermissionError as e:
        raise errors.Unauthorized(
            f"cannot open {path}: {e.strerror}; the memory tier is readable by transferd's user and, "
            "with its store_group setting, by that group's members") from e
    except FileNotFoundError as e:
        raise errors.NotReady(f"{path} is gone (evicted?); ask for the hand-off again") from e
    try:
        if os.fstat(fd).st_size == 0:
            return b""
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


class _Slice:
    """``f.get_slice(name)``: shape and dtype without reading, and ``[...]`` indexing that
    reads only what it selects (within the rank's part under tensor parallelism)."""

    def __init__(self, reader, name):
        self._r, self._name = reader, name
        self._info = reader._info(name)

    def get_shape(self):
        return list(self._r._rank_shape(self._info))

    def get_dtype(self):
        return self._info.dtype

    def __getitem__(self, key):
        return self._r._tensor(self._info, key)

    def __len__(self):
        shape = self.get_shape()
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]


class SafeOpen:
    """What :func:`safe_open` returns; see there."""

    def __init__(self, model, framework="numpy", device="cpu", *, agent=None, tensors=None, prefixes=None,
                 tp_rank=None, tp_size=None, shard_dims=None, wait=0.0, handoff=None, **agent_kwargs):
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework {framework!r}: expected 'numpy' or 'pt'")
        self.framework = FRAMEWORKS[framework]
        self.device = str(device) if device is not None else "cpu"
        if self.framework == "numpy" and self.device != "cpu":
            raise ValueError("framework='numpy' reads to device='cpu' only; use framework='pt' for GPUs")
        if (tp_rank is None) != (tp_size is None):
            raise ValueError("tp_rank and tp_size go together")
        self.tp_rank, self.tp_size = (tp_rank, tp_size) if tp_size else (0, 1)
        if self.tp_size > 1 or tp_rank is not None:
            tp.rank_range(1, self.tp_rank, self.tp_size)  # validates
        self.shard_dims = dict(shard_dims or {})
        self.model = model
        self.agent = agent if agent is not None else Agent(**agent_kwargs)
        if handoff is None:
            kw = {"tensors": list(tensors) if tensors else None, "prefixes": list(prefixes) if prefixes else None}
            handoff = self.agent.wait_ready(model, timeout=wait, **kw) if wait else self.agent.handoff(model, **kw)
        self.handoff = handoff
        self._selected = bool(tensors or prefixes)
        self._maps = {}
        self._regions = {}
        self._torch = None
        self._cuda_index = None
        self._closed = False
        if self.framework == "pt":
            try:
                import torch
            except ImportError as e:
                raise ImportError("framework='pt' needs PyTorch (pip install torch)") from e
            self._torch = torch
        if self.device.startswith("cuda"):
            from ._cuda import torch_cuda

            self._torch, self._cuda_index = torch_cuda(self.device)
        elif self.device != "cpu":
            raise ValueError(f"device {self.device!r}: expected 'cpu' or 'cuda:N'")
        self.source = self._choose_source()

    # -- the safetensors interface ------------------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def keys(self):
        """Tensor names, sorted (as ``safetensors``)."""
        return sorted(self.handoff.tensors)

    def offset_keys(self):
        """Tensor names in the order they lie in the region."""
        return [t.name for t in sorted(self.handoff.tensors.values(), key=lambda t: t.offset)]

    def metadata(self):
        """The ``__metadata__`` of the safetensors headers (merged over shards; ``None`` when
        none has any), read from the held bytes."""
        out = {}
        found = False
        for s in self.handoff.shards:
            if not s.path.endswith(".safetensors"):
                continue
            header = self._header(s)
            if header is None:
                continue
            meta = header.get("__metadata__")
            if meta is not None:
                found = True
                for k, v in meta.items():
                    out.setdefault(k, v)
        return out if found else None

    def get_tensor(self, name):
        """The tensor ``name`` (under tensor parallelism: the rank's part of a split tensor),
        viewing the held bytes (numpy arrays and CPU/IPC tensors); ``.to(device)`` copies
        only when the bytes are not on that device already."""
        return self._tensor(self._info(name), None)

    def get_slice(self, name):
        return _Slice(self, name)

    def close(self):
        """Drops this reader's mappings. Tensors already returned stay valid: each holds a
        reference to its mapping (or CUDA IPC region), which is unmapped when the last
        one is gone. (Mappings are never closed explicitly: ``torch.frombuffer`` keeps the
        object, not a buffer export, so closing would leave its tensors dangling.)"""
        if self._closed:
            return
        self._closed = True
        self._maps.clear()
        self._regions.clear()

    # -- shardcast extras ----------------------------------------------------------------------
    @property
    def kind(self):
        return self.handoff.kind

    def tensor_info(self, name):
        return self._info(name)

    def split_dim(self, name):
        """The dimension tensor ``name`` is split along for this rank, or ``None``."""
        return tp.dim_for(name, self.shard_dims) if self.tp_size > 1 else None

    def rank_byte_ranges(self, name):
        """``[(offset in the region, length)]`` of the bytes this rank reads of ``name``."""
        t = self._info(name)
        itemsize = DTYPES[t.dtype][1]
        return [(t.offset + o, n) for o, n in tp.byte_ranges(t.shape, itemsize, self.split_dim(name),
                                                               self.tp_rank, self.tp_size)]

    # -- internals -----------------------------------------------------------------------------
    def _info(self, name):
        if self._closed:
            raise errors.ShardcastError("this safe_open is closed")
        try:
            return self.handoff.tensors[name]
        except KeyError:
            raise KeyError(f"model {self.handoff.name or self.model} has no tensor {name!r}"
                           + (" in the selected tensors" if self._selected else "")) from None

    def _rank_shape(self, t):
        idx = tp.rank_index(t.shape, self.split_dim(t.name), self.tp_rank, self.tp_size)
        return tuple(len(range(*s.indices(n))) for s, n in zip(idx, t.shape))

    def _choose_source(self):
        h = self.handoff
        files = all(s.file for s in h.shards) and bool(h.shards)
        if h.kind == "cuda-ipc":
            if self._cuda_index is not None:
                if any(d.gpu == self._cuda_index for d in h.devices):
                    return "ipc"
                if files:
                    return "memory"
                return "ipc-other"
            if files:
                return "memory"
            raise errors.NotReady(
                f"model {h.name} is on GPUs {h.gpus} only (a partition, or no memory-tier copy): "
                "read it with framework='pt', device='cuda:N'")
        if h.kind == "simulated":
            return "simulated"
        if h.kind == "memory-file":
            if not files:
                raise errors.NotReady(f"the hand-off of {h.name} names no memory-tier files")
            return "memory"
        raise errors.ShardcastError(f"unknown hand-off kind {h.kind!r}")

    def _mapping(self, key, path):
        m = self._maps.get(key)
        if m is None:
            m = self._maps[key] = _map(path)
        return m

    def _host_bytes(self, t):
        """``(buffer, start)`` of tensor ``t`` in a host mapping."""
        if self.source == "simulated":
            devs = self.handoff.devices
            dev = next((d for d in devs if d.gpu == self._cuda_index), devs[0])
            path = dev.handle.get("path")
            if not path:
                raise errors.ShardcastError(f"simulated GPU {dev.gpu}: the hand-off names no backing file")
            if t.offset + t.nbytes > dev.size:
                raise errors.ShardcastError(f"{t.name} lies past the region of GPU {dev.gpu}")
            return self._mapping(("sim", dev.gpu), path), int(dev.handle.get("offset", 0)) + t.offset
        s = self.handoff.shard(t.shard)
        buf = self._mapping(("file", s.path), s.file)
        start = t.offset - s.offset
        if start < 0 or start + t.nbytes > len(buf):
            raise errors.ShardcastError(f"{t.name} lies outside its shard file {s.file}")
        return buf, start

    def _header(self, s):
        try:
            if self.source == "simulated":
                devs = self.handoff.devices
                dev = next((d for d in devs if d.gpu == self._cuda_index), devs[0])
                buf = self._mapping(("sim", dev.gpu), dev.handle["path"])
                base = int(dev.handle.get("offset", 0)) + s.offset
            elif s.file:
                buf, base = self._mapping(("file", s.path), s.file), 0
            else:
                return None
            (n,) = struct.unpack_from("<Q", buf, base)
            if n > 100 << 20:
                return None
            return json.loads(bytes(buf[base + 8: base + 8 + n]))
        except (ValueError, struct.error, OSError, errors.ShardcastError):
            return None

    def _region(self, gpu):
        r = self._regions.get(gpu)
        if r is None:
            from ._cuda import open_region

            dev = next(d for d in self.handoff.devices if d.gpu == gpu)
            if dev.handle.get("kind") != "cuda-ipc":
                raise errors.ShardcastError(f"GPU {gpu}: the hand-off has no CUDA IPC handle")
            r = self._regions[gpu] = open_region(self._torch, gpu, dev.handle["handle"],
                                                 int(dev.handle.get("offset", 0)), dev.size)
        return r

    def _full(self, t):
        """The whole tensor as a view (numpy array or torch tensor), on its own device."""
        n = 1
        for s in t.shape:
            n *= s
        if self.source in ("ipc", "ipc-other"):
            gpu = self._cuda_index if self.source == "ipc" else self.handoff.devices[0].gpu
            return self._region(gpu).tensor(t.offset, t.nbytes, _torch_dtype(self._torch, t.dtype), t.shape)
        buf, start = self._host_bytes(t)
        if self.framework == "numpy":
            import numpy as np

            dt = _np_dtype(t.dtype)
            if n == 0:
                return np.empty(t.shape, dtype=dt)
            return np.frombuffer(buf, dtype=dt, count=n, offset=start).reshape(t.shape)
        torch = self._torch
        dt = _torch_dtype(torch, t.dtype)
        if n == 0:
            return torch.empty(t.shape, dtype=dt)
        return torch.frombuffer(buf, dtype=dt, count=n, offset=start).reshape(t.shape)

    def _tensor(self, t, key):
        x = self._full(t)
        dim = self.split_dim(t.name)
        if dim is not None:
            x = x[tp.rank_index(t.shape, dim, self.tp_rank, self.tp_size)]
        if key is not None:
            x = x[key]
        if self._cuda_index is not None and self.framework == "pt":
            target = f"cuda:{self._cuda_index}"
            if str(x.device) != target:
                x = x.to(target)
        return x


def safe_open(model, framework="numpy", device="cpu", **kw):
    """Opens ``model`` (name or hex digest) as held by the local transferd, like
    ``safetensors.safe_open(filename, framework, device)``: ``keys()``, ``get_tensor(name)``,
    ``get_slice(name)[...]``, ``metadata()``, and a context manager.

    ``framework``: ``"numpy"`` or ``"pt"``; ``device``: ``"cpu"`` or ``"cuda:N"`` (``pt``).
    Tensors view the daemon's memory (no copy): numpy arrays over a copy-on-write mapping of
    the memory-tier file, CUDA tensors over the daemon's GPU region when the model is resident
    on GPU N (CUDA IPC). They stay valid after ``close()``.

    Keywords: ``agent`` (a :class:`shardcast.Agent`; else one is made from ``address``, ``ca``,
    ``cert``, ``key``, ``token``, ``token_file`` or the environment), ``tensors`` / ``prefixes``
    (hand off only these), ``tp_rank`` / ``tp_size`` / ``shard_dims`` (``{name or glob:
    dim}``: the rank's part of each split tensor), ``wait`` (seconds to wait for the model to
    become ready).
    """
    return SafeOpen(model, framework, device, **kw)
