"""Loads a model with vLLM's own model loader, in this process, on the CPU, twice: once as
``vllm serve MODEL_DIR --load-format FORMAT --model-loader-extra-config EXTRA`` would (FORMAT
``shardcast``: weights from the local transferd; or vLLM's ``safetensors`` from MODEL_DIR),
once with vLLM's default safetensors loader from REFERENCE_DIR (the original files). Prints
one JSON line: how each load went and whether every parameter of the two models is equal.

Run by ``test_vllm_engine.py`` in a process of its own (vLLM sets process-wide state: its
platform, torch.distributed). Needs vLLM with its PyTorch; no GPU (``VLLM_TARGET_DEVICE=cpu``).

    python vllm_load.py MODEL_DIR FORMAT '{"model": ..., "admin": ...}' REFERENCE_DIR PORT [TP RANK]

(PORT: a free loopback port for torch.distributed's group; TP ranks, one process each, this
one RANK: vLLM's tensor parallelism, each rank holding its part of every sharded parameter.)
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader import get_model, get_model_loader  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402


def engine_config(model_dir, load_format, extra=None, tp=1):
    """The engine configuration ``vllm serve MODEL_DIR --load-format ...`` builds, from its
    command line."""
    argv = ["--model", model_dir, "--load-format", load_format, "--dtype", "float32", "--enforce-eager",
            "--skip-tokenizer-init", "--max-model-len", "128", "--tensor-parallel-size", str(tp)]
    if extra is not None:
        argv += ["--model-loader-extra-config", json.dumps(extra)]
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(argv)
    return EngineArgs.from_cli_args(args).create_engine_config()


def load(cfg):
    t = time.monotonic()
    with set_current_vllm_config(cfg):
        model = get_model(vllm_config=cfg)
    return model, time.monotonic() - t


def main():
    model_dir, load_format, extra, reference_dir, port = sys.argv[1:6]
    tp, rank = (int(sys.argv[6]), int(sys.argv[7])) if len(sys.argv) > 7 else (1, 0)
    extra = json.loads(extra)
    out = {}
    # What `vllm serve` does first in every process: the general plugins, shardcast's
    # entry point among them.
    load_general_plugins()
    cfg = engine_config(model_dir, load_format, extra, tp)
    out["loader"] = type(get_model_loader(cfg.load_config)).__name__
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tp, 1)
    try:
        loaded, out["load_s"] = load(cfg)
    except Exception as e:  # reported, for the test to check the kind
        out["error"] = f"{type(e).__module__}.{type(e).__name__}: {e}"
        print(json.dumps(out))
        return
    out["model_class"] = type(loaded).__name__
    reference, out["reference_s"] = load(engine_config(reference_dir, "safetensors", tp=tp))
    a, b = dict(loaded.named_parameters()), dict(reference.named_parameters())
    out["parameters"] = sorted(a)
    out["differ"] = sorted(set(a) ^ set(b)) + sorted(n for n in set(a) & set(b) if not torch.equal(a[n], b[n]))
    out["bytes"] = sum(p.numel() * p.element_size() for p in a.values())
    out["shapes"] = {n: list(p.shape) for n, p in a.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
