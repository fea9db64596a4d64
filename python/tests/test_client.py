"""The controller client: register, prewarm with progress, status, scale-out, errors."""

import pytest

import shardcast
from conftest import MODEL


def test_register_prewarm_and_watch_progress(cluster, held):
    c = cluster.client("read", token=True)
    info = c.model(MODEL)
    assert info["digest"] == held["digest"] and info["name"] == MODEL
    assert {s["path"] for s in info["shards"]} >= {"model-00001-of-00002.safetensors", "config.json"}
    st = c.status(MODEL)
    holders = {h["host"] for h in st["hosts"] if h.get("memory")}
    assert holders >= {"host-1", "host-2"}, st
    # A second prewarm is served by the holders: every receiver is "local" at once.
    platform = cluster.client("platform")
    seen = []
    final = platform.wait(platform.prewarm(MODEL, replicas=2), timeout=60, progress=seen.append)
    assert final["state"] == "done" and seen and seen[-1]["state"] == "done"
    assert all(h["state"] in ("local", "done") for h in final["hosts"]), final
    assert any(p["plan_id"] == final["plan_id"] for p in c.plans())
    done, total = shardcast.plan_progress(final)
    assert total == 0 or done == total


def test_watch_streams_a_fresh_plan_until_done(cluster, held):
    # A third daemon joins; a scale-out to it is a real chain from a holder.
    cluster.start_daemon("host-3")
    cluster.wait_hosts(3)
    platform = cluster.client("platform", token=True)
    accepted = platform.scale_out(MODEL, replicas=1)
    assert accepted["plan_id"] and accepted["hosts"]
    updates = list(platform.watch(accepted["plan_id"], timeout=60))
    assert updates[-1]["state"] == "done", updates[-1]
    h3 = [h for h in updates[-1]["hosts"] if h["host"] == "host-3"]
    assert h3 and h3[0]["state"] == "done" and h3[0]["bytes"] == h3[0]["total"] > 0
    assert h3[0]["source"] in ("host-1", "host-2"), h3  # from a peer, not the origin


def test_controller_errors(cluster, held):
    with pytest.raises(shardcast.UnknownModel) as e:
        cluster.client("read").status("test/no-such-model")
    assert "no-such-model" in str(e.value) and e.value.status == 404
    with pytest.raises(shardcast.UnknownModel):
        cluster.client("platform").prewarm("test/no-such-model", replicas=1)
    with pytest.raises(shardcast.NotFound):
        cluster.client("read").plan("ffffffffffffffff")
    # A read token may not prewarm (403); an unknown token is refused (401).
    with pytest.raises(shardcast.Unauthorized) as e:
        cluster.client("read", token=True).prewarm(MODEL, replicas=1)
    assert e.value.status == 403
    bad = shardcast.Client(cluster.controller_url, ca=str(cluster.pki / "ca.pem"), token="shc_" + "0" * 64)
    with pytest.raises(shardcast.Unauthorized) as e:
        bad.models()
    assert e.value.status == 401
    with pytest.raises(shardcast.InvalidRequest):
        cluster.client("platform").prewarm(MODEL, replicas=1, tier="floppy")


def test_token_from_file_and_environment(cluster, held, tmp_path, monkeypatch):
    f = tmp_path / "token"
    f.write_text(cluster.tokens["read"] + "\n")
    c = shardcast.Client(cluster.controller_url, ca=str(cluster.pki / "ca.pem"), token_file=str(f))
    assert c.model(MODEL)["digest"] == held["digest"]
    monkeypatch.setenv("SHARDCAST_CONTROLLER_URL", cluster.controller_url)
    monkeypatch.setenv("SHARDCAST_TLS_CA", str(cluster.pki / "ca.pem"))
    monkeypatch.setenv("SHARDCAST_TOKEN_FILE", str(f))
    assert shardcast.Client().model(MODEL)["digest"] == held["digest"]


def test_dead_controller_is_unavailable(cluster):
    c = shardcast.Client("https://127.0.0.1:1", ca=str(cluster.pki / "ca.pem"), timeout=5)
    with pytest.raises(shardcast.ControllerUnavailable):
        c.models()
    assert not c.healthy()


def test_report_load_and_events(cluster, held):
    platform = cluster.client("platform")
    decision = platform.report_load(MODEL, arrival_rate=0.1, service_rate=10.0)
    assert decision.get("kind"), decision
    events = cluster.client("read").events(MODEL)
    assert events and all(e["model"] == MODEL for e in events)
    table = cluster.client("read").partition_plan(MODEL, max_partitions=2)
    assert isinstance(table, dict) and table


def test_a_plan_short_of_a_host_raises_plan_partial(tmp_path):
    """A host stopped (SIGSTOP) just as a prewarm to it starts never gets its copy: the
    controller marks it lost and the plan ends ``partial``, not ``done``; ``wait`` raises
    PlanPartial (a PlanFailed) naming it, and the other hosts hold the model."""
    import os
    import signal

    from conftest import managed

    with managed(tmp_path / "c") as c:
        # No lost grace: the plan gives the stopped host up at once instead of waiting.
        c.start_controller("--lost-grace-s", "0")
        for name in ("host-1", "host-2", "host-3"):
            c.start_daemon(name)
        c.wait_hosts(3)
        c.client("admin").register(MODEL, c.origin_uri, chunk_size=256 << 10, via_host="host-1")
        platform = c.client("platform")
        victim = c.daemons["host-3"]
        os.kill(victim.p.pid, signal.SIGSTOP)
        try:
            plan = platform.prewarm(MODEL, hosts=["host-2", "host-3"])
            with pytest.raises(shardcast.PlanPartial) as e:
                platform.wait(plan, timeout=60)
        finally:
            os.kill(victim.p.pid, signal.SIGCONT)
        assert isinstance(e.value, shardcast.PlanFailed)
        assert [h["host"] for h in e.value.short] == ["host-3"], e.value.plan
        assert e.value.short[0]["state"] == "lost", e.value.plan
        assert "host-3" in str(e.value) and "1 of 2 hosts" in str(e.value)
        assert e.value.plan["state"] == "partial"
        assert [h["state"] for h in e.value.plan["hosts"] if h["host"] == "host-2"] == ["done"]
