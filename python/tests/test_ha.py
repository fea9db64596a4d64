"""``shardcast.Client`` over two controller replicas on a real etcd: writes sent to the
follower reach the leader, and a killed leader is replaced without the caller noticing.
etcd comes from PATH (``.ci/setup`` installs Debian's ``etcd-server``)."""

import shutil
import socket
import subprocess
import time
import urllib.request

import pytest
import shardcast

from conftest import MODEL, Proc, managed


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    def __init__(self, root):
        exe = shutil.which("etcd")
        if exe is None:
            pytest.fail("etcd is needed for this test: run .ci/setup as root, or `apt-get install etcd-server`")
        self.client = f"127.0.0.1:{free_port()}"
        peer = f"http://127.0.0.1:{free_port()}"
        self.p = subprocess.Popen(
            [exe, "--name", "py", "--data-dir", str(root / "etcd"), "--listen-client-urls", f"http://{self.client}",
             "--advertise-client-urls", f"http://{self.client}", "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"py={peer}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(root / "etcd.log", "ab"))
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.client}/health", timeout=2) as r:
                    if b'"health":"true"' in r.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.p.poll() is not None:
                self.kill()
                raise RuntimeError("etcd did not become healthy within 20 s")
            time.sleep(0.1)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


def replica(c, etcd, name):
    d = c.root / name
    d.mkdir()
    sock = d / "controller.sock"
    argv = [str(c.bins / "shardcast-controller"), "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
            "--unix", str(sock), "--state-dir", str(d / "state"), "--heartbeat-ms", "200",
            "--state", f"etcd://{etcd.client}", "--replica-id", name,
            "--tokens-file", str(c.tokens_file), "--origin-allow", c.origin_uri + "/",
            *c.tls_args("controller", name)]
    p = Proc(argv, d / "controller.log", f"controller {name}")
    c.procs.append(p)
    p.sock = sock
    p.url = "https://" + p.fields["http"]
    return p


def role(c, p):
    client = shardcast.Client(p.url, ca=str(c.pki / "ca.pem"), cert=c.cert("read", "py-read")[1],
                              key=c.cert("read", "py-read")[2])
    try:
        return client._call("GET", "/v1/replica")["role"]
    except shardcast.ShardcastError:
        return None


def test_client_follows_the_leader_and_survives_its_death(tmp_path):
    with managed(tmp_path) as c:
        etcd = Etcd(tmp_path)
        try:
            first = replica(c, etcd, "ctl-1")
            deadline = time.monotonic() + 20
            while role(c, first) != "leader":
                assert time.monotonic() < deadline, "ctl-1 did not become leader"
                time.sleep(0.1)
            second = replica(c, etcd, "ctl-2")
            c.ctl_sock = f"{first.sock},unix:{second.sock}"
            c.start_daemon("host-1")
            # The follower first: its refusal names the leader, and the call goes there.
            _, cert, key = c.cert("admin", "py-admin")
            api = shardcast.Client([second.url, first.url], ca=str(c.pki / "ca.pem"), cert=cert, key=key)
            deadline = time.monotonic() + 20
            while not any(h.get("up") for h in shardcast.Client(first.url, ca=str(c.pki / "ca.pem"), cert=cert,
                                                                 key=key).hosts()):
                assert time.monotonic() < deadline, "host-1 never heartbeated to the leader"
                time.sleep(0.1)
            api.register(MODEL, c.origin_uri, chunk_size=256 << 10)
            assert api.url.split(",")[api._current] == first.url
            # The leader dies: the next write waits for the new one (about the lease TTL).
            first.kill()
            t0 = time.monotonic()
            plan = api.prewarm(MODEL, hosts=["host-1"], tier="memory")
            took = time.monotonic() - t0
            assert took < 10, took
            assert api.wait(plan, timeout=60)["state"] == "done"
            assert role(c, second) == "leader"
            assert [m["name"] for m in api.models()] == [MODEL]
        finally:
            etcd.kill()
