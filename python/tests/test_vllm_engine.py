"""The vLLM loader inside vLLM itself (marked ``vllm``; skipped unless vLLM is installed:
``SHARDCAST_TEST_VLLM=1 python/run-tests.sh`` installs it, about 9 GB with PyTorch).

vLLM builds its engine configuration from a ``vllm serve`` command line with ``--load-format
shardcast``, finds the loader through this package's ``vllm.general_plugins`` entry point,
instantiates its real ``LlamaForCausalLM`` on the CPU and loads it from a real transferd.
The result must equal, parameter by parameter, the same model loaded by vLLM's own
safetensors loader from the original files. And the path for engines without the plug-in:
vLLM's own safetensors loader pointed at ``link_model_dir``'s links into the memory tier. No GPU: vLLM runs on its CPU platform, and nothing is generated (the
PyPI wheel has no CPU kernels); loading is what is tested.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import shardcast

pytestmark = pytest.mark.vllm

VLLM_MODEL = "test/vllm-llama"
SCRIPT = Path(__file__).parent / "support" / "vllm_load.py"


def write_llama(d):
    """A real (tiny) Llama checkpoint vLLM can instantiate: HF config and safetensors with
    the names ``LlamaForCausalLM.load_weights`` expects, q/k/v and gate/up separate (vLLM
    stacks them into its fused parameters while loading)."""
    import numpy as np
    from safetensors.numpy import save_file

    h, inter, vocab, layers, heads, kv_heads = 64, 128, 256, 2, 4, 2
    kv = kv_heads * (h // heads)
    rng = np.random.default_rng(11)

    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    t = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": w(h), "lm_head.weight": w(vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
                  p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
                  p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                  p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": w(h),
                  p + "post_attention_layernorm.weight": w(h)})
    d.mkdir(parents=True)
    # Two shards, as real checkpoints come.
    names = sorted(t)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, keys in parts.items():
        save_file({k: t[k] for k in keys}, str(d / f), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(x.nbytes for x in t.values())},
         "weight_map": {k: f for f, keys in parts.items() for k in keys}}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 128,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    (d / "config.json").write_text(json.dumps(config))
    return config


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_argv(model_dir, load_format, extra, reference_dir, port, tp=1, rank=0):
    return [sys.executable, str(SCRIPT), str(model_dir), load_format, json.dumps(extra), str(reference_dir),
            str(port), str(tp), str(rank)]


VLLM_ENV = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="WARNING")


def result(returncode, stdout, stderr):
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert returncode == 0 and lines, f"vLLM load failed ({returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return json.loads(lines[-1])


def vllm_load(model_dir, load_format, extra, reference_dir, tmp_path):
    """vLLM's load of ``model_dir`` with ``load_format``, against its safetensors load of
    ``reference_dir`` (support/vllm_load.py, in a process of its own)."""
    argv = vllm_argv(model_dir, load_format, extra, reference_dir, free_port())
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=VLLM_ENV, cwd=tmp_path)
    return result(r.returncode, r.stdout, r.stderr)


@pytest.fixture(scope="module")
def llama(cluster):
    """The Llama checkpoint in the cluster's origin, registered and held in host-2's memory
    tier: the original directory, and one that holds its ``config.json`` only."""
    original = cluster.origin / "vllm-llama"
    config = write_llama(original)
    admin = cluster.client("admin")
    admin.register(VLLM_MODEL, f"{cluster.origin_uri}/vllm-llama", chunk_size=256 << 10)
    platform = cluster.client("platform", token=True)
    final = platform.wait(platform.prewarm(VLLM_MODEL, hosts=["host-2"], tier="memory"), timeout=60)
    assert final["state"] == "done", final
    config_dir = cluster.root / "vllm-config-only"
    config_dir.mkdir(exist_ok=True)
    (config_dir / "config.json").write_text(json.dumps(config))
    return original, config_dir


def test_vllm_loads_the_model_through_shardcast_equal_to_its_own_loader(cluster, llama, tmp_path):
    original, config_dir = llama
    # The directory vLLM is pointed at holds no weights: they can only come from transferd.
    extra = {"model": VLLM_MODEL, "admin": cluster.daemons["host-2"].admin, "wait_s": 30}
    out = vllm_load(config_dir, "shardcast", extra, original, tmp_path)
    assert out.get("error") is None, out
    assert out["loader"] == "ShardcastModelLoader", out
    assert out["model_class"] == "LlamaForCausalLM", out
    # vLLM's fused parameters were filled from the separate tensors shardcast handed over.
    assert "model.layers.0.self_attn.qkv_proj.weight" in out["parameters"], out["parameters"]
    assert "model.layers.1.mlp.gate_up_proj.weight" in out["parameters"], out["parameters"]
    assert out["differ"] == [], out
    assert out["bytes"] > 0


def test_vllm_reads_the_memory_tier_through_link_model_dir(cluster, llama, tmp_path):
    """README's way for engines without the plug-in: links into transferd's memory tier,
    which vLLM's own safetensors loader mmaps."""
    original, _ = llama
    linked = shardcast.link_model_dir(VLLM_MODEL, tmp_path / "linked", agent=cluster.agent("host-2"))
    weights = sorted(p for p in linked.iterdir() if p.suffix == ".safetensors")
    assert len(weights) == 2 and all(p.is_symlink() for p in weights), list(linked.iterdir())
    held = Path(os.path.realpath(weights[0]))
    assert held.is_relative_to(cluster.root / "host-2" / "mem"), held
    out = vllm_load(linked, "safetensors", {}, original, tmp_path)
    assert out.get("error") is None, out
    assert out["loader"] == "DefaultModelLoader", out
    assert out["differ"] == [], out


def test_vllm_with_an_unknown_model_fails_with_shardcasts_error(cluster, llama, tmp_path):
    _, config_dir = llama
    extra = {"model": "test/absent", "admin": cluster.daemons["host-2"].admin, "wait_s": 1}
    out = vllm_load(config_dir, "shardcast", extra, config_dir, tmp_path)
    assert out["loader"] == "ShardcastModelLoader", out
    assert out.get("error", "").startswith("shardcast.errors.UnknownModel"), out


def test_vllm_tensor_parallel_ranks_each_load_their_part_through_shardcast(cluster, llama, tmp_path):
    """Two tensor-parallel ranks (one process each, a gloo group on loopback): each takes the
    hand-off's views and vLLM's weight loaders narrow them to the rank's part."""
    original, config_dir = llama
    extra = {"model": VLLM_MODEL, "admin": cluster.daemons["host-2"].admin, "wait_s": 30}
    port = free_port()
    procs = [subprocess.Popen(vllm_argv(config_dir, "shardcast", extra, original, port, tp=2, rank=r),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=VLLM_ENV, cwd=tmp_path)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            outs.append(result(p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    config = json.loads((config_dir / "config.json").read_text())
    for rank, out in enumerate(outs):
        assert out.get("error") is None, (rank, out)
        assert out["loader"] == "ShardcastModelLoader", out
        assert out["differ"] == [], (rank, out)
        # Each rank holds half of the sharded parameters.
        assert out["shapes"]["model.layers.0.self_attn.o_proj.weight"] == [config["hidden_size"],
                                                                           config["hidden_size"] // 2], out["shapes"]
        assert out["shapes"]["model.layers.0.mlp.down_proj.weight"] == [config["hidden_size"],
                                                                        config["intermediate_size"] // 2]
