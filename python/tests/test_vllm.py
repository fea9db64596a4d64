"""The vLLM loader: the (name, tensor) iterator, and registration against vLLM's
model-loader interface (a stand-in module when vLLM is not installed)."""

import sys
import types

import pytest

import shardcast
import shardcast.vllm as sv
from conftest import MODEL, reference, torch_or_none


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


@pytest.fixture
def fake_vllm(monkeypatch):
    """vLLM's documented loader interface, as a stand-in: BaseModelLoader(load_config) with
    abstract download_model/load_weights, and register_model_loader(load_format)."""
    import abc

    registry = {}

    class BaseModelLoader(abc.ABC):
        def __init__(self, load_config):
            self.load_config = load_config

        @abc.abstractmethod
        def download_model(self, model_config): ...

        @abc.abstractmethod
        def load_weights(self, model, model_config): ...

    def register_model_loader(load_format):
        def deco(cls):
            assert issubclass(cls, BaseModelLoader)
            registry[load_format] = cls
            return cls

        return deco

    mod = types.ModuleType("vllm.model_executor.model_loader")
    mod.BaseModelLoader, mod.register_model_loader = BaseModelLoader, register_model_loader
    for name in ("vllm", "vllm.model_executor"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader", mod)
    monkeypatch.setattr(sv, "_registered", {})
    return registry


def test_loader_registers_and_loads_weights(cluster, held, fake_vllm):
    want, _ = reference(cluster.origin)
    cls = sv.register()
    assert fake_vllm["shardcast"] is cls and sv.register() is cls

    class LoadConfig:
        model_loader_extra_config = {"model": MODEL, "admin": cluster.daemons["host-2"].admin, "wait_s": 5}
        if torch_or_none() is None:
            model_loader_extra_config["framework"] = "numpy"

    class ModelConfig:
        model = "/models/ignored-config-dir"

    class Model:
        def __init__(self):
            self.got = {}

        def load_weights(self, weights):
            for name, t in weights:
                self.got[name] = t.numpy() if hasattr(t, "numpy") else t
            return set(self.got)

        def named_parameters(self):
            return [(k, None) for k in want]

    loader = cls(LoadConfig())
    loader.download_model(ModelConfig())
    m = Model()
    loader.load_weights(m, ModelConfig())
    assert sorted(m.got) == sorted(want)
    for k, v in m.got.items():
        assert v.tobytes() == want[k].tobytes(), k


def test_unknown_model_in_download_model(cluster, held, fake_vllm):
    cls = sv.register()

    class LoadConfig:
        model_loader_extra_config = {"model": "test/absent", "admin": cluster.daemons["host-2"].admin,
                                     "wait_s": 0.5}

    with pytest.raises(shardcast.UnknownModel):
        cls(LoadConfig()).download_model(types.SimpleNamespace(model="x"))
