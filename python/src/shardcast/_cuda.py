"""CUDA IPC: maps a model's GPU region, handed off by transferd, into this process
(``cuIpcOpenMemHandle`` through ctypes on ``libcuda``) and wraps tensors over it with
PyTorch (``__cuda_array_interface__``): no host copy, no second GPU allocation."""

import ctypes
import threading
import weakref

from . import errors


class _CUipcMemHandle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


_lib = None
_lock = threading.RLock()
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


def libcuda():
    """The CUDA driver library, or :class:`GpuUnavailable`."""
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise errors.GpuUnavailable(f"no CUDA driver in this process (libcuda.so.1: {e})") from e
            open_ = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
            open_.argtypes = [ctypes.POINTER(ctypes.c_uint64), _CUipcMemHandle, ctypes.c_uint]
            open_.restype = ctypes.c_int
            close = lib.cuIpcCloseMemHandle
            close.argtypes = [ctypes.c_uint64]
            close.restype = ctypes.c_int
            lib._sc_open, lib._sc_close = open_, close
            _lib = lib
        return _lib


def torch_cuda(device):
    """``(torch, index)`` for ``device`` (``"cuda"``, ``"cuda:N"``), or :class:`GpuUnavailable`
    with the reason."""
    try:
        import torch
    except ImportError as e:
        raise errors.GpuUnavailable(f"device={device!r} needs PyTorch with CUDA; PyTorch is not installed") from e
    if not torch.cuda.is_available():
        raise errors.GpuUnavailable(
            f"device={device!r}: PyTorch sees no CUDA device in this process (torch {torch.__version__}); "
            "use device='cpu' to read the memory tier")
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise errors.GpuUnavailable(f"device={device!r}: this process sees {torch.cuda.device_count()} CUDA devices")
    return torch, index


class IpcRegion:
    """One GPU's region of a model, opened through its CUDA IPC handle. Closed
    (``cuIpcCloseMemHandle``) when the last tensor over it and this object are gone, or by
    :meth:`close` — after which tensors over it must not be used."""

    def __init__(self, torch, gpu, handle_hex, offset, size):
        raw = bytes.fromhex(handle_hex)
        if len(raw) != 64:
            raise errors.ShardcastError(f"GPU {gpu}: an IPC handle of {len(raw)} bytes, expected 64")
        self.torch, self.gpu, self.size = torch, gpu, size
        lib = libcuda()
        with torch.cuda.device(gpu):
            torch.zeros(1, device=f"cuda:{gpu}")  # makes the primary context current
            ptr = ctypes.c_uint64()
            rc = lib._sc_open(ctypes.byref(ptr), _CUipcMemHandle.from_buffer_copy(raw),
                              CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        if rc != 0:
            hint = " (CUDA IPC needs the daemon on the same host, and not the same process)" if rc == 1 else ""
            raise errors.ShardcastError(f"GPU {gpu}: cuIpcOpenMemHandle failed with CUresult {rc}{hint}")
        self._mapped = ptr.value
        self.base = ptr.value + offset

    def tensor(self, offset, nbytes, dtype, shape):
        """A tensor of ``dtype`` and ``shape`` over ``nbytes`` at ``offset`` in the region (no
        copy); it keeps the region open while it lives."""
        if offset < 0 or offset + nbytes > self.size:
            raise errors.ShardcastError(f"GPU {self.gpu}: bytes {offset}..{offset + nbytes} lie past the region "
                                        f"of {self.size} bytes")
        region = self

        class _View:
            __cuda_array_interface__ = {
                "shape": (nbytes,),
                "typestr": "|u1",
                "data": (self.base + offset, False),
                "version": 3,
            }
            _keep = region  # closes the handle only after every tensor is gone

        t = self.torch.as_tensor(_View(), device=f"cuda:{self.gpu}")
        return t.view(dtype).reshape(shape) if nbytes else self.torch.empty(shape, dtype=dtype,
                                                                                device=f"cuda:{self.gpu}")

    def close(self):
        if self._mapped:
            m, self._mapped = self._mapped, 0
            try:
                libcuda()._sc_close(m)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass

    def __del__(self):
        self.close()


_open_regions = weakref.WeakValueDictionary()


def open_region(torch, gpu, handle_hex, offset, size):
    """The :class:`IpcRegion` of a handle, shared while any reader or tensor of this process
    still uses it (a handle is opened once per process and closed after its last user)."""
    key = (gpu, handle_hex, offset)
    with _lock:
        r = _open_regions.get(key)
        if r is None:
            r = _open_regions[key] = IpcRegion(torch, gpu, handle_hex, offset, size)
        return r
