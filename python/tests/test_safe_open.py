"""safe_open over held models returns exactly what the safetensors package reads from the
original files, without copying; tensor-parallel slices."""

import numpy as np
import pytest

import shardcast
from conftest import MODEL, reference, torch_or_none

HOSTS = ["host-2", "host-1"]  # memory-tier files over a Unix socket; simulated GPU regions over HTTPS


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("host", HOSTS)
def test_every_tensor_matches_safetensors(cluster, held, host):
    want, meta = reference(cluster.origin)
    with shardcast.safe_open(MODEL, framework="numpy", agent=cluster.agent(host)) as f:
        assert f.kind == ("memory-file" if host == "host-2" else "simulated")
        assert f.keys() == sorted(want)
        assert f.metadata() == meta
        for k in f.keys():
            got = f.get_tensor(k)
            same(got, want[k])
            # A view of the mapping, not a copy.
            assert not got.flags.owndata or got.size == 0, k
            s = f.get_slice(k)
            assert s.get_shape() == list(want[k].shape) and s.get_dtype()
            if want[k].ndim >= 1 and want[k].shape[0] >= 3:
                same(s[1:3], want[k][1:3])
            if want[k].ndim == 2:
                same(f.get_slice(k)[:, 2:5], want[k][:, 2:5])
        held_tensor = f.get_tensor("model.embed_tokens.weight")
    # Tensors stay valid after close.
    same(held_tensor, want["model.embed_tokens.weight"])


def test_arrays_are_private_copy_on_write(cluster, held):
    want, _ = reference(cluster.origin)
    with shardcast.safe_open(MODEL, agent=cluster.agent("host-2")) as f:
        x = f.get_tensor("extra.i32")
        x[0, 0] = 999  # writes stay in this process
    with shardcast.safe_open(MODEL, agent=cluster.agent("host-2")) as f:
        same(f.get_tensor("extra.i32"), want["extra.i32"])


SHARD_DIMS = {"*.q_proj.weight": 0, "*.k_proj.weight": 0, "*.up_proj.weight": 0, "*.o_proj.weight": 1,
              "*.down_proj.weight": 1, "model.embed_tokens.weight": 0, "extra.uneven": 0}


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_slices(cluster, held, host, world):
    want, _ = reference(cluster.origin)
    parts = {}
    for rank in range(world):
        with shardcast.safe_open(MODEL, agent=cluster.agent(host), tp_rank=rank, tp_size=world,
                                 shard_dims=SHARD_DIMS) as f:
            for k in f.keys():
                dim = f.split_dim(k)
                got = f.get_tensor(k)
                if dim is None:
                    same(got, want[k])
                    continue
                expect = np.array_split(want[k], world, axis=dim)[rank]
                same(np.ascontiguousarray(got), expect)
                assert f.get_slice(k).get_shape() == list(expect.shape)
                same(np.ascontiguousarray(f.get_slice(k)[:2]), expect[:2])
                parts.setdefault(k, []).append(np.ascontiguousarray(got))
                # The rank's bytes: one range per split for dim 0, one per row for dim 1.
                ranges = f.rank_byte_ranges(k)
                assert sum(n for _, n in ranges) == expect.nbytes
                if dim == 0:
                    assert len(ranges) == 1
    for k, ps in parts.items():
        same(np.concatenate(ps, axis=SHARD_DIMS.get(k, 0) if k in SHARD_DIMS else
                            next(d for p, d in SHARD_DIMS.items() if k.endswith(p.lstrip("*")))), want[k])


def test_partial_handoff_of_one_rank(cluster, held):
    """A rank asks the daemon for its tensors only and maps only those shards."""
    want, _ = reference(cluster.origin)
    names = [k for k in want if k.startswith("model.layers.1.")]
    with shardcast.safe_open(MODEL, agent=cluster.agent("host-2"), prefixes=["model.layers.1."], tp_rank=1,
                             tp_size=2, shard_dims=SHARD_DIMS) as f:
        assert f.keys() == sorted(names)
        assert [s.path for s in f.handoff.shards] == ["model-00002-of-00002.safetensors"]
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
        same(q, np.array_split(want["model.layers.1.self_attn.q_proj.weight"], 2)[1])
        assert f.metadata() == {"format": "pt", "producer": "shardcast-tests"}
        with pytest.raises(KeyError):
            f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        # Only shard 2 was mapped.
        assert {k[1] for k in f._maps} <= {"model-00002-of-00002.safetensors"}


def test_bad_arguments(cluster, held):
    agent = cluster.agent("host-2")
    with pytest.raises(ValueError):
        shardcast.safe_open(MODEL, framework="jax", agent=agent)
    with pytest.raises(ValueError):
        shardcast.safe_open(MODEL, framework="numpy", device="cuda:0", agent=agent)
    with pytest.raises(ValueError):
        shardcast.safe_open(MODEL, agent=agent, tp_rank=2, tp_size=2)


@pytest.mark.torch
@pytest.mark.parametrize("host", HOSTS)
def test_torch_cpu_tensors(cluster, held, host):
    torch = torch_or_none()
    from safetensors.torch import load_file

    want = {}
    for p in sorted(cluster.origin.glob("*.safetensors")):
        want.update(load_file(str(p)))
    with shardcast.safe_open(MODEL, framework="pt", device="cpu", agent=cluster.agent(host)) as f:
        for k in f.keys():
            got = f.get_tensor(k)
            assert got.dtype == want[k].dtype and got.shape == want[k].shape, k
            assert torch.equal(got, want[k]), k
        s = f.get_slice("model.embed_tokens.weight")[10:20]
        assert torch.equal(s, want["model.embed_tokens.weight"][10:20])
        kept = f.get_tensor("lm_head.weight")
    import gc

    gc.collect()
    assert torch.equal(kept, want["lm_head.weight"])  # the mapping outlives the reader


@pytest.mark.torch
def test_cuda_device_without_a_gpu_is_a_clear_error(cluster, held):
    torch = torch_or_none()
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(shardcast.GpuUnavailable) as e:
        shardcast.safe_open(MODEL, framework="pt", device="cuda:0", agent=cluster.agent("host-2"))
    assert "device='cpu'" in str(e.value)
