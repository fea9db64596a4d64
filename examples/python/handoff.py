#!/usr/bin/env python3
"""Open a model's hand-off from transferd and build tensors from it without copying.

    python3 examples/python/handoff.py --admin https://127.0.0.1:7402 --tls-ca ca.pem \
        --tls-cert read-infer.pem --tls-key read-infer.key --model org/llama-3-8b
    python3 examples/python/handoff.py --admin https://127.0.0.1:7402 --tls-ca ca.pem \
        --token "$SHARDCAST_TOKEN" --model org/llama-3-8b
    python3 examples/python/handoff.py --unix /run/shardcast/admin.sock --model org/llama-3-8b

transferd serves the hand-off at GET /v1/handoff/{model} on its admin listener, to callers
that may read: over HTTPS with a client certificate of the cluster CA (role read, platform,
admin or controller) or a bearer token from transferd's tokens_file, or on its Unix socket
(admin_listen = "unix:/path") to the daemon's user and, with store_group, that group's
members. With insecure_plaintext it is plain HTTP on loopback (http://).

* kind "cuda-ipc": per GPU holding the model, the region that holds it -- `gpu`, a CUDA IPC
  memory handle of the model's own device allocation, the region's `offset` in it (0) and
  its length `size` -- plus the tensor index. With PyTorch and a GPU, `open_cuda_ipc` maps
  the region (cuIpcOpenMemHandle) and wraps each tensor at its offset: no host copy, no
  second GPU allocation. Each model has its own allocation, so opening one model's handle
  maps nothing else; close it (cuIpcCloseMemHandle) before the model is evicted.
* kind "simulated": the simulated region's own backing file and offset (hosts without
  GPUs, CI).
* kind "memory-file": the memory-tier shard files (no GPU on the host).

For simulated and memory-file hand-offs the script maps the bytes (mmap) and builds each
tensor (numpy when installed, else a typed memoryview); for cuda-ipc it builds PyTorch
tensors over the GPU memory. Either way it checks every tensor against the same bytes in
the memory-tier shard file (for cuda-ipc by copying each back from the GPU). It prints one line per tensor with --verbose
and exits non-zero on any mismatch.
"""

import argparse
import ctypes
import http.client
import json
import mmap
import os
import socket
import ssl
import sys
import urllib.parse

# safetensors dtype -> (struct/memoryview format, numpy dtype name, bytes per element)
DTYPES = {
    "F64": ("d", "float64", 8),
    "F32": ("f", "float32", 4),
    "F16": ("e", "float16", 2),
    "BF16": ("H", "uint16", 2),  # no native bfloat16 in numpy/struct: raw 16-bit words
    "I64": ("q", "int64", 8),
    "I32": ("i", "int32", 4),
    "I16": ("h", "int16", 2),
    "I8": ("b", "int8", 1),
    "U8": ("B", "uint8", 1),
    "BOOL": ("?", "bool", 1),
}


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over transferd's admin Unix socket."""

    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def fetch(a):
    """The hand-off JSON of a.model, from the admin listener a.admin or socket a.unix."""
    path = "/v1/handoff/" + urllib.parse.quote(a.model, safe="")
    headers = {"Authorization": f"Bearer {a.token}"} if a.token else {}
    if a.unix:
        conn = UnixHTTPConnection(a.unix, timeout=30)
    else:
        url = urllib.parse.urlsplit(a.admin)
        if url.scheme == "https":
            # The cluster CA: transferd's certificate names localhost and the loopback
            # addresses by default (more with `shardcast certs issue --dns/--ip`).
            ctx = ssl.create_default_context(cafile=a.ca)
            if a.cert:
                ctx.load_cert_chain(a.cert, a.key)
            conn = http.client.HTTPSConnection(url.hostname, url.port or 7402, timeout=30, context=ctx)
        else:
            conn = http.client.HTTPConnection(url.hostname, url.port or 7402, timeout=30)
    conn.request("GET", path, headers=headers)
    r = conn.getresponse()
    body = r.read()
    if r.status != 200:
        sys.exit(f"hand-off of {a.model!r} not available: {r.status} {body.decode().strip()}")
    return json.loads(body)


def build(buf, base, t):
    """A tensor viewing `buf` at region offset t['offset'] (no copy)."""
    fmt, npname, size = DTYPES.get(t["dtype"], ("B", "uint8", 1))
    start = base + t["offset"]
    view = memoryview(buf)[start : start + t["nbytes"]]
    try:
        import numpy as np  # optional

        arr = np.frombuffer(view, dtype=npname)
        return arr.reshape(t["shape"]) if t["shape"] else arr
    except ImportError:
        return view.cast(fmt)


class CUipcMemHandle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def open_cuda_ipc(h):
    """Maps each GPU's region through its CUDA IPC handle (driver API,
    cuIpcOpenMemHandle; the handle opens the model's own allocation, the region starts
    handle.offset bytes into it and is `size` bytes long) and returns
    {gpu: (base address, {name: tensor})}: each tensor views the GPU memory at its offset,
    with no host copy and no second GPU allocation. Needs PyTorch with CUDA on the same
    host as transferd."""
    import torch

    cuda = ctypes.CDLL("libcuda.so.1")
    open_handle = getattr(cuda, "cuIpcOpenMemHandle_v2", None) or cuda.cuIpcOpenMemHandle
    open_handle.argtypes = [ctypes.POINTER(ctypes.c_uint64), CUipcMemHandle, ctypes.c_uint]
    out = {}
    for dev in h["devices"]:
        raw = bytes.fromhex(dev["handle"]["handle"])
        if len(raw) != 64:
            raise RuntimeError(f"GPU {dev['gpu']}: an IPC handle of {len(raw)} bytes, expected 64")
        torch.cuda.set_device(dev["gpu"])
        torch.zeros(1, device=f"cuda:{dev['gpu']}")  # makes the primary context current
        ptr = ctypes.c_uint64()
        # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
        # from_buffer_copy keeps every byte (initialising a c_char array stops at a NUL).
        rc = open_handle(ctypes.byref(ptr), CUipcMemHandle.from_buffer_copy(raw), 1)
        if rc != 0:
            raise RuntimeError(f"GPU {dev['gpu']}: cuIpcOpenMemHandle failed with CUresult {rc}")
        base = ptr.value + dev["handle"]["offset"]
        tensors = {}
        for t in h["tensors"]:
            if t["offset"] + t["nbytes"] > dev["size"]:
                raise RuntimeError(f"GPU {dev['gpu']}: tensor {t['name']} lies past its region of {dev['size']} bytes")
            _, npname, _ = DTYPES.get(t["dtype"], ("B", "uint8", 1))
            dtype = getattr(torch, {"uint16": "bfloat16"}.get(npname, npname))
            typestr = "<u2" if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype.str
            tensors[t["name"]] = cuda_view(torch, dev["gpu"], base + t["offset"], t["shape"], typestr)
            if dtype == torch.bfloat16:
                tensors[t["name"]] = tensors[t["name"]].view(torch.bfloat16)
        out[dev["gpu"]] = (base, tensors)
    return out


def cuda_view(torch, gpu, addr, shape, typestr):
    """A tensor over device memory at `addr` (zero copy, __cuda_array_interface__)."""

    class Wrap:
        __cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (addr, False),
            "version": 3,
        }

    return torch.as_tensor(Wrap(), device=f"cuda:{gpu}")


def check_cuda(h, mapped, verbose):
    """Copies every tensor back from each GPU and compares it with the memory-tier files."""
    import torch

    files = shard_files(h)
    bad = 0
    for gpu, (base, _) in sorted(mapped.items()):
        for t in h["tensors"]:
            shard_map, shard_off = files[t["shard"]]
            want = bytes(memoryview(build(shard_map, -shard_off, t)).cast("B"))
            got = cuda_view(torch, gpu, base + t["offset"], [t["nbytes"]], "|u1").cpu().numpy().tobytes()
            if got != want:
                print(f"MISMATCH {t['name']} on GPU {gpu}", file=sys.stderr)
                bad += 1
            elif verbose:
                print(f"{t['name']:60s} {t['dtype']:5s} {t['shape']} GPU {gpu}")
    return bad


def shard_files(h):
    """{path: (mapped memory-tier file, offset of the shard in the region)}."""
    files = {}
    for s in sorted(h["shards"], key=lambda s: s["offset"]):
        if s["file"]:
            f = open(s["file"], "rb")
            files[s["path"]] = (mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if s["size"] else b"", s["offset"])
    return files


def check_host(h, verbose):
    files = shard_files(h)
    regions = []
    if h["kind"] == "simulated":
        for dev in h["devices"]:
            path, off = dev["handle"]["path"], dev["handle"]["offset"]
            f = open(path, "rb")
            regions.append((f"simulated GPU {dev['gpu']}", mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), off, dev["size"]))
    bad = 0
    for t in h["tensors"]:
        shard_map, shard_off = files[t["shard"]]
        want = build(shard_map, -shard_off, t)
        for label, buf, base, size in regions:
            if t["offset"] + t["nbytes"] > size:
                print(f"{t['name']} lies past the region on {label} ({size} bytes)", file=sys.stderr)
                bad += 1
                continue
            got = build(buf, base, t)
            if bytes(memoryview(got).cast("B")) != bytes(memoryview(want).cast("B")):
                print(f"MISMATCH {t['name']} on {label}", file=sys.stderr)
                bad += 1
        if verbose:
            print(f"{t['name']:60s} {t['dtype']:5s} {t['shape']}")
    return bad


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--admin", default=os.environ.get("SHARDCAST_ADMIN", "https://127.0.0.1:7402"))
    p.add_argument("--unix", default=os.environ.get("SHARDCAST_ADMIN_SOCKET"), help="admin Unix socket instead of --admin")
    p.add_argument("--tls-ca", dest="ca", default=os.environ.get("SHARDCAST_TLS_CA"), help="cluster CA bundle (PEM)")
    p.add_argument("--tls-cert", dest="cert", default=os.environ.get("SHARDCAST_TLS_CERT"), help="client certificate (PEM), e.g. role read")
    p.add_argument("--tls-key", dest="key", default=os.environ.get("SHARDCAST_TLS_KEY"), help="its private key (PEM)")
    p.add_argument("--token", default=os.environ.get("SHARDCAST_TOKEN"), help="bearer token instead of a certificate")
    p.add_argument("--model", required=True, help="model name or hex digest")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args()
    if a.cert and not a.key:
        p.error("--tls-cert needs --tls-key")
    h = fetch(a)
    if h["kind"] == "cuda-ipc":
        mapped = open_cuda_ipc(h)
        bad = check_cuda(h, mapped, a.verbose)
        if bad:
            sys.exit(f"{bad} tensors differ")
        print(f"OK {len(h['tensors'])} tensors from cuda-ipc hand-off of {h['name']} (GPUs {sorted(mapped)})")
        return
    bad = check_host(h, a.verbose)
    gpus = [d["gpu"] for d in h["devices"]]
    if bad:
        sys.exit(f"{bad} tensors differ")
    print(f"OK {len(h['tensors'])} tensors from {h['kind']} hand-off of {h['name']} (GPUs {gpus})")


if __name__ == "__main__":
    main()
