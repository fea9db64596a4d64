"""The local transferd: hand-offs, model status, clear errors."""

import pytest

import shardcast
from conftest import MODEL


def test_handoff_and_status(cluster, held):
    h = cluster.agent("host-1").handoff(MODEL)
    assert h.kind == "simulated" and h.gpus
    assert h.name == MODEL and h.model == held["digest"]
    assert set(h.tensors) == set(cluster.tensors)
    st = cluster.agent("host-2").model_status(MODEL)
    assert st["state"] == "memory" and st["kind"] == "memory-file" and st["tensors"] == len(cluster.tensors)
    assert cluster.agent("host-1").model_status(held["digest"])["state"] == "gpu"
    files = cluster.agent("host-2").files(MODEL)
    assert "config.json" in files and files["config.json"].startswith(str(cluster.root))
    assert "shardcast_bytes_received_total" in cluster.agent("host-1", token=True).metrics()


def test_server_side_selection(cluster, held):
    a = cluster.agent("host-2")
    names = ["model.layers.1.mlp.up_proj.weight", "extra.ids"]
    h = a.handoff(MODEL, tensors=names)
    assert sorted(h.tensors) == sorted(names)
    assert [s.path for s in h.shards] == ["model-00002-of-00002.safetensors"]
    h = a.handoff(MODEL, prefixes=["model.layers.0."])
    assert h.tensors and all(n.startswith("model.layers.0.") for n in h.tensors)
    assert [s.path for s in h.shards] == ["model-00001-of-00002.safetensors"]
    with pytest.raises(shardcast.InvalidRequest) as e:
        a.handoff(MODEL, tensors=["no.such.tensor"])
    assert "no.such.tensor" in str(e.value)
    # The same on the GPU-resident host.
    h = cluster.agent("host-1").handoff(MODEL, tensors=names)
    assert sorted(h.tensors) == sorted(names) and h.kind == "simulated"


def test_unknown_model(cluster, held):
    for name in ("host-1", "host-2"):
        with pytest.raises(shardcast.UnknownModel) as e:
            cluster.agent(name).handoff("test/no-such-model")
        assert e.value.status == 404 and "no-such-model" in str(e.value)
    with pytest.raises(shardcast.UnknownModel):
        shardcast.safe_open("test/no-such-model", agent=cluster.agent("host-2"))


def test_refused_tokens_and_certificates(cluster, held):
    p = cluster.daemons["host-1"]
    ca = str(cluster.pki / "ca.pem")
    with pytest.raises(shardcast.Unauthorized) as e:
        shardcast.Agent(p.admin, ca=ca, token="shc_" + "1" * 64).handoff(MODEL)
    assert e.value.status == 401
    with pytest.raises(shardcast.Unauthorized) as e:
        shardcast.Agent(p.admin, ca=ca).handoff(MODEL)  # no identity at all
    assert e.value.status == 401
    # A host certificate may not read.
    c, k = cluster.cert("host", "host-2")[1:]
    with pytest.raises(shardcast.Unauthorized) as e:
        shardcast.Agent(p.admin, ca=ca, cert=c, key=k).handoff(MODEL)
    assert e.value.status == 403
    # A certificate of another CA is refused in the TLS handshake.

    other = cluster.root / "other-pki"
    cluster.cli("certs", "init", "--dir", str(other))
    cluster.cli("certs", "issue", "--dir", str(other), "--role", "read", "--name", "stranger")
    with pytest.raises(shardcast.Unauthorized):
        shardcast.Agent(p.admin, ca=ca, cert=str(other / "read-stranger.pem"),
                        key=str(other / "read-stranger.key")).handoff(MODEL)
    # Tokens of every role that may read work.
    for role in ("read", "platform", "admin"):
        assert cluster.agent("host-1", role=role, token=True).handoff(MODEL).tensors
    # The daemon's certificate is checked against the CA.
    with pytest.raises(shardcast.DaemonUnavailable) as e:
        shardcast.Agent(p.admin, token=cluster.tokens["read"]).handoff(MODEL)
    assert "certificate" in str(e.value)


def test_dead_daemon(cluster, tmp_path):
    with pytest.raises(shardcast.DaemonUnavailable) as e:
        shardcast.Agent(f"unix:{tmp_path}/none.sock").handoff(MODEL)
    assert "not reachable" in str(e.value)
    d = cluster.start_daemon("doomed", managed=False)
    agent = cluster.agent("doomed")
    assert agent.healthy()
    d.kill()
    with pytest.raises(shardcast.DaemonUnavailable):
        agent.handoff(MODEL)
    assert not agent.healthy()
    with pytest.raises(shardcast.DaemonUnavailable):
        shardcast.safe_open(MODEL, agent=agent)


def test_link_model_dir_for_engines_that_load_a_directory(cluster, held, tmp_path):
    from safetensors import safe_open as st_open

    from conftest import reference

    want, _ = reference(cluster.origin)
    d = shardcast.link_model_dir(MODEL, tmp_path / "m", agent=cluster.agent("host-2"))
    names = sorted(p.name for p in d.iterdir())
    assert "config.json" in names and "model.safetensors.index.json" in names
    assert all((d / n).is_symlink() for n in names)
    assert str((d / "config.json").resolve()).startswith(str(cluster.root / "host-2" / "mem"))
    with st_open(str(d / "model-00002-of-00002.safetensors"), framework="numpy") as f:
        for k in f.keys():
            assert f.get_tensor(k).tobytes() == want[k].tobytes()
