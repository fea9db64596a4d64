"""Real shardcast processes on loopback for the Python package's tests: a throw-away
cluster CA, a controller, and transferd daemons (simulated GPUs, no GPUs, and on a CUDA
host a real GPU), with a small safetensors model in a ``file://`` origin.

Binaries come from ``$SHARDCAST_BIN_DIR`` or ``<repo>/target/debug`` (``cargo build --bins``).
"""

import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
try:
    import shardcast
except ImportError:  # not installed: the source tree
    sys.path.insert(0, str(REPO / "python" / "src"))
    import shardcast

MODEL = "test/tiny-llama"
BINS = ("transferd", "shardcast-controller", "shardcast")


def bin_dir():
    d = Path(os.environ.get("SHARDCAST_BIN_DIR", REPO / "target" / "debug"))
    missing = [b for b in BINS if not (d / b).is_file()]
    if missing:
        pytest.exit(f"missing {missing} in {d}: run `cargo build --bins` (or set SHARDCAST_BIN_DIR)", 2)
    return d


def torch_or_none():
    try:
        import torch

        return torch
    except ImportError:
        return None


def cuda_available():
    torch = torch_or_none()
    return bool(torch is not None and torch.cuda.is_available())


def vllm_available():
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs PyTorch with CUDA and a CUDA GPU")
    skip_torch = pytest.mark.skip(reason="needs PyTorch (pip install torch)")
    skip_vllm = pytest.mark.skip(reason="needs vLLM (SHARDCAST_TEST_VLLM=1 python/run-tests.sh)")
    has_torch = torch_or_none() is not None
    has_cuda = cuda_available()
    has_vllm = vllm_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "torch" in item.keywords and not has_torch:
            item.add_marker(skip_torch)
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(skip_vllm)


# -- the model ---------------------------------------------------------------------------------
def write_model(d):
    """A two-shard safetensors model with an HF index and a config; returns {name: array}."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(7)
    h, inter, vocab = 64, 96, 2048
    a = {"model.embed_tokens.weight": rng.standard_normal((vocab, h), dtype=np.float32)}
    b = {}
    for i in range(2):
        p = f"model.layers.{i}."
        dst = a if i == 0 else b
        dst[p + "self_attn.q_proj.weight"] = rng.standard_normal((h, h)).astype(np.float16)
        dst[p + "self_attn.k_proj.weight"] = rng.standard_normal((h, h)).astype(np.float16)
        dst[p + "self_attn.o_proj.weight"] = rng.standard_normal((h, h)).astype(np.float16)
        dst[p + "mlp.up_proj.weight"] = rng.standard_normal((inter, h), dtype=np.float32)
        dst[p + "mlp.down_proj.weight"] = rng.standard_normal((h, inter), dtype=np.float32)
        dst[p + "input_layernorm.weight"] = rng.standard_normal(h, dtype=np.float32)
    b["model.norm.weight"] = rng.standard_normal(h, dtype=np.float32)
    b["lm_head.weight"] = rng.standard_normal((vocab, h), dtype=np.float32)
    # Odd sizes and other dtypes.
    b["extra.uneven"] = rng.standard_normal((33, 10)).astype(np.float64)
    b["extra.ids"] = np.arange(-50, 50, dtype=np.int64).reshape(4, 25)
    b["extra.i32"] = np.arange(12, dtype=np.int32).reshape(3, 4)
    b["extra.u8"] = np.arange(200, dtype=np.uint8)
    b["extra.mask"] = rng.random(17) > 0.5
    b["extra.scalar"] = np.array(3.5, dtype=np.float32)
    files = {"model-00001-of-00002.safetensors": a, "model-00002-of-00002.safetensors": b}
    meta = {"format": "pt", "producer": "shardcast-tests"}
    for fname, tensors in files.items():
        save_file(tensors, str(d / fname), metadata=meta)
    index = {"metadata": {"total_size": sum(x.nbytes for t in files.values() for x in t.values())},
             "weight_map": {k: f for f, t in files.items() for k in t}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": h}))
    return {k: v for t in files.values() for k, v in t.items()}


# -- processes ---------------------------------------------------------------------------------
class Proc:
    """A process started until its READY line; killed (by PID) at teardown."""

    def __init__(self, argv, log, what, timeout=60):
        self.what, self.log_path = what, log
        self.log = open(log, "ab")
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log)
        deadline = time.monotonic() + timeout
        buf = b""
        while b"\n" not in buf or not any(ln.startswith(b"READY") for ln in buf.split(b"\n")):
            left = deadline - time.monotonic()
            if left <= 0 or self.p.poll() is not None:
                self.kill()
                raise RuntimeError(f"{what} did not become ready: {self.tail()}")
            r, _, _ = select.select([self.p.stdout], [], [], min(left, 0.5))
            if r:
                chunk = os.read(self.p.stdout.fileno(), 65536)
                if not chunk:
                    continue
                buf += chunk
        line = next(ln for ln in buf.split(b"\n") if ln.startswith(b"READY")).decode()
        self.fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        try:
            while self.p.stdout.read(65536):
                pass
        except (OSError, ValueError):
            pass

    def tail(self):
        try:
            return Path(self.log_path).read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                pass


class Cluster:
    """A throw-away CA, tokens, a controller and daemons under one scratch directory."""

    def __init__(self, root):
        self.root = Path(root)
        self.bins = bin_dir()
        self.procs = []
        self.pki = self.root / "pki"
        self.cli("certs", "init", "--dir", str(self.pki))
        self.origin = self.root / "origin"
        self.origin.mkdir()
        self.tensors = write_model(self.origin)
        self.origin_uri = f"file://{self.origin}"
        self.tokens = {}
        lines = []
        for role in ("read", "platform", "admin"):
            out = self.cli("certs", "token", "--role", role, "--name", f"py-{role}")
            tok = next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("token:"))
            lines.append(next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("tokens-file")))
            self.tokens[role] = tok
        self.tokens_file = self.root / "tokens"
        self.tokens_file.write_text("\n".join(lines) + "\n")
        self.controller = None
        self.daemons = {}

    def cli(self, *args):
        return subprocess.run([str(self.bins / "shardcast"), *args], check=True, capture_output=True,
                              text=True).stdout

    def cert(self, role, name):
        """``(ca, cert, key)`` for ``shardcast://role/name``, issued on first use."""
        cert = self.pki / f"{role}-{name}.pem"
        if not cert.exists():
            self.cli("certs", "issue", "--dir", str(self.pki), "--role", role, "--name", name)
        return str(self.pki / "ca.pem"), str(cert), str(self.pki / f"{role}-{name}.key")

    def tls_args(self, role, name):
        ca, cert, key = self.cert(role, name)
        return ["--tls-ca", ca, "--tls-cert", cert, "--tls-key", key]

    def start_controller(self, *extra):
        d = self.root / "controller"
        d.mkdir()
        self.ctl_sock = d / "controller.sock"
        argv = [str(self.bins / "shardcast-controller"), "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
                "--unix", str(self.ctl_sock), "--state-dir", str(d / "state"), "--heartbeat-ms", "200",
                "--tokens-file", str(self.tokens_file), "--origin-allow", self.origin_uri + "/",
                *self.tls_args("controller", "ctl"), *extra]
        self.controller = Proc(argv, d / "controller.log", "shardcast-controller")
        self.procs.append(self.controller)
        self.controller_url = "https://" + self.controller.fields["http"]
        return self.controller

    def start_daemon(self, name, gpu_args=("--gpu-backend", "none"), admin_socket=False, managed=True):
        d = self.root / name
        (d / "mem").mkdir(parents=True)
        (d / "disk").mkdir()
        admin = f"unix:{d / 'admin.sock'}" if admin_socket else "127.0.0.1:0"
        argv = [str(self.bins / "transferd"), "--host-id", name, "--listen", "127.0.0.1:0",
                "--agent-listen", f"unix:{d / 'agent.sock'}", "--admin-listen", admin,
                "--memory-dir", str(d / "mem"), "--data-dir", str(d / "disk"),
                "--tokens-file", str(self.tokens_file), "--origin-allow", self.origin_uri + "/",
                "--heartbeat-ms", "200", *gpu_args, *self.tls_args("host", name)]
        if managed:
            argv += ["--controller", f"unix:{self.ctl_sock}"]
        p = Proc(argv, d / "transferd.log", f"transferd {name}")
        self.procs.append(p)
        a = p.fields.get("admin", "")
        p.admin = a if a.startswith("unix:") else "https://" + a
        self.daemons[name] = p
        return p

    def client(self, role="admin", token=False, **kw):
        ca = str(self.pki / "ca.pem")
        if token:
            return shardcast.Client(self.controller_url, ca=ca, token=self.tokens[role], **kw)
        _, cert, key = self.cert(role, f"py-{role}")
        return shardcast.Client(self.controller_url, ca=ca, cert=cert, key=key, **kw)

    def agent(self, name, role="read", token=False, **kw):
        p = self.daemons[name]
        if p.admin.startswith("unix:"):
            return shardcast.Agent(p.admin, **kw)
        ca = str(self.pki / "ca.pem")
        if token:
            return shardcast.Agent(p.admin, ca=ca, token=self.tokens[role], **kw)
        _, cert, key = self.cert(role, f"py-{role}")
        return shardcast.Agent(p.admin, ca=ca, cert=cert, key=key, **kw)

    def wait_hosts(self, n, timeout=30):
        c = self.client("read")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = [h for h in c.hosts() if h.get("up")]
            if len(up) >= n:
                return up
            time.sleep(0.2)
        raise RuntimeError(f"fewer than {n} hosts up after {timeout} s: {c.hosts()}")

    def logs(self):
        return "\n".join(f"--- {p.what} ---\n{p.tail()}" for p in self.procs)

    def stop(self):
        for p in reversed(self.procs):
            p.kill()


@contextlib.contextmanager
def managed(root):
    """A :class:`Cluster` under ``root`` that is stopped (its logs printed when the body
    failed) and removed at the end, unless ``SHARDCAST_KEEP_SCRATCH`` is set."""
    c = Cluster(root)
    try:
        yield c
    except BaseException:
        sys.stderr.write(c.logs())
        raise
    finally:
        c.stop()
        if os.environ.get("SHARDCAST_KEEP_SCRATCH") is None:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A controller, ``host-1`` (2 simulated GPUs, admin over HTTPS) and ``host-2`` (no GPUs,
    admin on a Unix socket), both managed; the model registered and held in both memory
    tiers, and resident on host-1's simulated GPUs."""
    root = tmp_path_factory.mktemp("shardcast-py")
    with managed(root) as c:
        c.start_controller()
        c.start_daemon("host-1", gpu_args=("--gpu-backend", "simulated", "--sim-gpus", "2", "--sim-gpu-memory",
                                           "64MiB", "--sim-pcie-rate", "2GB/s"))
        c.start_daemon("host-2", admin_socket=True)
        c.wait_hosts(2)
        yield c


@pytest.fixture(scope="session")
def held(cluster):
    """The model registered and prewarmed to both hosts' memory tiers, then host-1's GPUs."""
    admin = cluster.client("admin")
    info = admin.register(MODEL, cluster.origin_uri, chunk_size=256 << 10)
    platform = cluster.client("platform", token=True)
    plan = platform.prewarm(MODEL, replicas=2, tier="memory")
    final = platform.wait(plan, timeout=60)
    assert final["state"] == "done", final
    gpu = platform.wait(platform.prewarm(MODEL, hosts=["host-1"], tier="gpu"), timeout=60)
    assert gpu["state"] == "done", gpu
    return info


def reference(origin):
    """{name: array} as the safetensors package reads the original files, and the merged
    metadata."""
    from safetensors import safe_open as st_open

    out, meta = {}, {}
    for f in sorted(origin.glob("*.safetensors")):
        with st_open(str(f), framework="numpy") as r:
            meta.update(r.metadata() or {})
            for k in r.keys():
                out[k] = r.get_tensor(k)
    return out, meta
