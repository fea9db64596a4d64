"""On a CUDA host: a model resident on a real GPU is read through the CUDA IPC hand-off
(views of the daemon's GPU memory, no copy), byte-exact against the safetensors package.

Run: ``PYTHONPATH=python/src python3 -m pytest python/tests -m gpu`` (skipped without
PyTorch + CUDA)."""

import pytest

import shardcast
import shardcast.vllm as sv
from conftest import MODEL, managed, torch_or_none

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("shardcast-cuda")
    with managed(root) as c:
        c.start_controller()
        c.start_daemon("cuda-1", gpu_args=("--gpu-backend", "cuda", "--gpu-budget", "2GiB"))
        c.wait_hosts(1)
        c.client("admin").register(MODEL, c.origin_uri, chunk_size=256 << 10)
        platform = c.client("platform")
        done = platform.wait(platform.prewarm(MODEL, hosts=["cuda-1"], tier="gpu"), timeout=120)
        assert done["state"] == "done", done
        yield c


def reference_torch(origin, device):
    from safetensors.torch import load_file

    want = {}
    for p in sorted(origin.glob("*.safetensors")):
        want.update(load_file(str(p), device=device))
    return want


def test_cuda_ipc_tensors_are_views_of_the_daemons_gpu_memory(cuda_cluster):
    torch = torch_or_none()
    agent = cuda_cluster.agent("cuda-1")
    h = agent.handoff(MODEL)
    assert h.kind == "cuda-ipc" and h.gpus, h
    gpu = h.gpus[0]
    want = reference_torch(cuda_cluster.origin, f"cuda:{gpu}")
    with shardcast.safe_open(MODEL, framework="pt", device=f"cuda:{gpu}", agent=agent) as f:
        assert f.source == "ipc"
        region = f._region(gpu)
        for k in f.keys():
            got = f.get_tensor(k)
            assert got.device == torch.device(f"cuda:{gpu}"), k
            assert got.dtype == want[k].dtype and got.shape == want[k].shape, k
            assert torch.equal(got, want[k]), k
            if got.numel():
                assert region.base <= got.data_ptr() < region.base + region.size, k  # no copy
        assert f.metadata() == {"format": "pt", "producer": "shardcast-tests"}
        kept = f.get_tensor("lm_head.weight")
        # A second reader in this process shares the opened handle.
        with shardcast.safe_open(MODEL, framework="pt", device=f"cuda:{gpu}", agent=agent) as g:
            assert g._region(gpu) is region
            assert torch.equal(g.get_tensor("extra.ids"), want["extra.ids"])
    torch.cuda.synchronize()
    assert torch.equal(kept, want["lm_head.weight"])  # valid after close


def test_cuda_tensor_parallel_slices(cuda_cluster):
    torch = torch_or_none()
    agent = cuda_cluster.agent("cuda-1")
    gpu = agent.handoff(MODEL).gpus[0]
    want = reference_torch(cuda_cluster.origin, f"cuda:{gpu}")
    dims = {"*.q_proj.weight": 0, "*.o_proj.weight": 1, "extra.uneven": 0}
    for rank in range(2):
        with shardcast.safe_open(MODEL, framework="pt", device=f"cuda:{gpu}", agent=agent, tp_rank=rank,
                                 tp_size=2, shard_dims=dims) as f:
            for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                      "extra.uneven", "model.norm.weight"):
                dim = f.split_dim(k)
                expect = want[k] if dim is None else torch.tensor_split(want[k], 2, dim=dim)[rank]
                assert torch.equal(f.get_tensor(k), expect), (k, rank)
                assert torch.equal(f.get_slice(k)[:1], expect[:1]), (k, rank)


def test_memory_tier_to_another_device_and_cpu(cuda_cluster):
    torch = torch_or_none()
    agent = cuda_cluster.agent("cuda-1")
    want = reference_torch(cuda_cluster.origin, "cpu")
    with shardcast.safe_open(MODEL, framework="pt", device="cpu", agent=agent) as f:
        assert f.source == "memory"
        for k in f.keys():
            assert torch.equal(f.get_tensor(k), want[k]), k
    with shardcast.safe_open(MODEL, framework="numpy", agent=agent) as f:
        assert f.get_tensor("extra.ids").tolist() == want["extra.ids"].tolist()


def test_vllm_iterator_yields_gpu_views_on_the_current_device(cuda_cluster):
    torch = torch_or_none()
    agent = cuda_cluster.agent("cuda-1")
    gpu = agent.handoff(MODEL).gpus[0]
    torch.cuda.set_device(gpu)
    want = reference_torch(cuda_cluster.origin, f"cuda:{gpu}")
    got = dict(sv.weights_iterator(MODEL, agent=agent))
    assert sorted(got) == sorted(want)
    for k, t in got.items():
        assert t.is_cuda and torch.equal(t, want[k]), k
