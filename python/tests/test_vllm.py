"""The vLLM loader without vLLM: the (name, tensor) iterator it feeds the model, and the
error when vLLM is missing. The loader inside vLLM itself: ``test_vllm_engine.py``."""

import sys

import pytest

import shardcast.vllm as sv
from conftest import MODEL, reference


def test_weights_iterator_yields_every_tensor(cluster, held):
    want, _ = reference(cluster.origin)
    got = dict(sv.weights_iterator(MODEL, agent=cluster.agent("host-2"), framework="numpy", device="cpu"))
    assert sorted(got) == sorted(want)
    for k, v in got.items():
        assert v.dtype == want[k].dtype and v.tobytes() == want[k].tobytes()


def test_register_without_vllm_says_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "vllm.model_executor", None)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader", None)
    monkeypatch.setattr(sv, "_registered", {})
    with pytest.raises(ImportError, match="vLLM"):
        sv.register()
