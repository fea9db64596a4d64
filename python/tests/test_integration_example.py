"""docs/INTEGRATION.md's example client (examples/python/faas_client.py) against a real local
cluster: a controller with TLS and a tokens file, three transferds, a registered model.

The script runs as a subprocess, as a FaaS would run it; its effect is checked through the
controller with another identity (a read certificate) and byte for byte in each host's
memory tier, not through what the script prints. The gRPC path the guide shows (the
`shardcast` CLI with a platform certificate) runs against the same cluster.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import MODEL, REPO, managed

SCRIPT = REPO / "examples" / "python" / "faas_client.py"
HOSTS = ("host-a", "host-b", "host-c")


@pytest.fixture(scope="module")
def faas(tmp_path_factory):
    """A controller and three transferds (no GPUs); the model registered through host-a,
    which keeps the copy it read (the controller's default), so host-b and host-c are fed
    by a chain from it."""
    with managed(tmp_path_factory.mktemp("faas")) as c:
        c.start_controller()
        for h in HOSTS:
            c.start_daemon(h)
        c.wait_hosts(len(HOSTS))
        c.client("admin").register(MODEL, c.origin_uri, chunk_size=256 << 10, via_host="host-a")
        yield c


def run_client(c, *args, token=None, token_file=None, timeout=120):
    # -I -S: no site-packages (so no shardcast package, nothing installed), no PYTHON*
    # variables: the script must work with the standard library alone.
    argv = [sys.executable, "-I", "-S", str(SCRIPT), "--controller", c.controller_url, "--ca",
            str(c.pki / "ca.pem"), "--model", MODEL, *args]
    if token is not None:
        argv += ["--token", token]
    if token_file is not None:
        argv += ["--token-file", str(token_file)]
    # No token or address from the environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCAST_")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def verified_holders(c, timeout=10):
    """{host: HostHolding} of the hosts the controller says hold a complete, verified
    memory copy (heartbeats carry holdings, so wait up to ``timeout`` for them)."""
    reader = c.client("read")
    deadline = time.monotonic() + timeout
    while True:
        st = reader.status(MODEL)
        total = st["model"]["total_bytes"]
        held = {h["host"]: h for h in st["hosts"]
                if h.get("up") and h.get("memory") and int(h.get("memory_bytes", 0)) == total}
        if set(HOSTS) <= set(held) or time.monotonic() > deadline:
            return st, held
        time.sleep(0.2)


def assert_exact_copy(c, host, digest):
    """The host's memory-tier files of the model are the origin's bytes."""
    d = c.root / host / "mem" / "models" / digest
    originals = sorted(p for p in c.origin.iterdir() if p.is_file())
    assert originals
    for o in originals:
        copy = d / o.name
        assert copy.is_file(), f"{host} lacks {o.name} under {d}"
        assert copy.read_bytes() == o.read_bytes(), f"{host}: {o.name} differs from the origin"


def test_prewarm_with_a_platform_token_file(faas, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(faas.tokens["platform"] + "\n")
    r = run_client(faas, "--replicas", "3", "--json", token_file=token_file)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    plan_id = out["accepted"]["plan_id"]
    assert out["plan"]["state"] == "done"
    # The progress went to stderr: the model list, the plan and the copies.
    assert MODEL in r.stderr and plan_id in r.stderr and "copies of" in r.stderr

    # Independently of the script: the controller's own record of the plan ...
    reader = faas.client("read")
    plan = reader.plan(plan_id)
    assert plan["state"] == "done", plan
    assert sorted(h["host"] for h in plan["hosts"]) == sorted(HOSTS), plan
    assert all(h["state"] in ("done", "local") for h in plan["hosts"]), plan
    # host-a held it from the registration; the others got it from a peer, not the origin.
    fed = {h["host"]: h for h in plan["hosts"] if h["state"] == "done"}
    assert set(fed) == {"host-b", "host-c"}, plan
    assert all(h["source"] in HOSTS for h in fed.values()), plan
    # ... every requested host holds a complete, verified copy ...
    st, held = verified_holders(faas)
    assert set(HOSTS) <= set(held), st
    # ... and the bytes in each memory tier are the origin's.
    for h in HOSTS:
        assert_exact_copy(faas, h, st["model"]["digest"])


def test_scale_out_onto_a_new_host(faas):
    platform = faas.client("platform")
    assert platform.wait(platform.prewarm(MODEL, hosts=list(HOSTS)), timeout=60)["state"] == "done"
    before = {p["plan_id"] for p in faas.client("read").plans()}
    faas.start_daemon("host-d")
    faas.wait_hosts(4)
    r = run_client(faas, "--replicas", "1", "--scale-out", "--json", token=faas.tokens["platform"])
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    plan = faas.client("read").plan(out["accepted"]["plan_id"])
    assert out["accepted"]["plan_id"] not in before
    # A scale-out's plan lists every replica: the three that held it as "local", the new
    # one fed by a chain from one of them.
    states = {h["host"]: (h["state"], h["source"]) for h in plan["hosts"]}
    assert plan["state"] == "done" and set(states) == {*HOSTS, "host-d"}, plan
    assert states["host-d"][0] == "done" and states["host-d"][1] in HOSTS, states
    assert all(states[h][0] == "local" for h in HOSTS), states
    reader = faas.client("read")
    deadline = time.monotonic() + 10
    while True:
        st = reader.status(MODEL)
        d = [h for h in st["hosts"] if h["host"] == "host-d"]
        if (d and d[0]["memory"]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert d and d[0]["memory"] and d[0]["memory_bytes"] == st["model"]["total_bytes"], st
    assert_exact_copy(faas, "host-d", st["model"]["digest"])


def test_a_wrong_token_is_refused_and_changes_nothing(faas):
    reader = faas.client("read")
    plans_before = len(reader.plans())
    r = run_client(faas, "--replicas", "3", token="shc_" + "0" * 64)
    assert r.returncode != 0
    assert "401" in r.stderr and "token" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    # A read token may list models but not prewarm: 403, no plan made.
    r = run_client(faas, "--replicas", "3", token=faas.tokens["read"])
    assert r.returncode != 0
    assert "403" in r.stderr and "platform" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert len(reader.plans()) == plans_before


def test_unknown_model_and_missing_token(faas):
    argv = [sys.executable, "-I", "-S", str(SCRIPT), "--controller", faas.controller_url, "--ca", str(faas.pki / "ca.pem"),
            "--model", "test/no-such-model", "--replicas", "1", "--token", faas.tokens["platform"]]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "not registered" in r.stderr, r.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCAST_")}
    r = subprocess.run(argv[:-2], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "no token" in r.stderr, r.stderr


def test_grpc_path_with_a_platform_certificate(faas):
    """The guide's gRPC call: the `shardcast` CLI with a platform certificate (the Python
    package has no gRPC client)."""
    ca, cert, key = faas.cert("platform", "faas")
    argv = [str(faas.bins / "shardcast"), "--controller", faas.controller.fields["grpc"], "--tls-ca", ca,
            "--tls-cert", cert, "--tls-key", key, "--json", "prewarm", MODEL, "--replicas", "3"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # A token is not a gRPC credential: without a certificate the CLI is refused.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDCAST_")}
    r = subprocess.run(argv[:3] + ["--tls-ca", ca, "models"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0, r.stdout
    st, held = verified_holders(faas)
    assert set(HOSTS) <= set(held), st


def test_a_partial_plan_exits_7(tmp_path):
    """A host stopped (SIGSTOP) as the prewarm to it starts never gets its copy; with no
    lost grace the plan ends ``partial`` and the script exits 7, naming the host."""
    import signal

    with managed(tmp_path / "c") as c:
        c.start_controller("--lost-grace-s", "0")
        for h in HOSTS:
            c.start_daemon(h)
        c.wait_hosts(len(HOSTS))
        c.client("admin").register(MODEL, c.origin_uri, chunk_size=256 << 10, via_host="host-a")
        victim = c.daemons["host-c"]
        os.kill(victim.p.pid, signal.SIGSTOP)
        try:
            r = run_client(c, "--replicas", "3", "--json", token=c.tokens["platform"])
        finally:
            os.kill(victim.p.pid, signal.SIGCONT)
        assert r.returncode == 7, r.stdout + r.stderr
        assert "ended partial" in r.stderr and "host-c" in r.stderr, r.stderr
        plan = c.client("read").plan(json.loads(r.stdout)["accepted"]["plan_id"])
        assert plan["state"] in ("partial", "done"), plan  # done if host-c completed since
        short = [h["host"] for h in json.loads(r.stdout)["plan"]["hosts"] if h["state"] not in ("done", "local")]
        assert short == ["host-c"], r.stdout
