"""The controller's HTTP/JSON API (``shardcast.Client``).

Answers are the messages of ``protocol/proto/controller.proto`` as plain dicts (field names
as in the ``.proto``). Errors raise :mod:`shardcast.errors` exceptions.
"""

import json
import os
import socket
import sys
import time
import urllib.parse

from . import errors
from ._transport import Endpoint

ENV_CONTROLLER = "SHARDCAST_CONTROLLER_URL"
DEFAULT_CONTROLLER = "https://127.0.0.1:7501"
ENDED = ("done", "partial", "failed")


def _q(name):
    # Model names may contain "/"; the routes take the rest of the path.
    return urllib.parse.quote(name, safe="/")


class Client:
    """Client of the controller's HTTP API (``--http-listen``, default
    ``https://127.0.0.1:7501``; ``SHARDCAST_CONTROLLER_URL``).

    Authenticate with a client certificate (``cert``/``key``; ``SHARDCAST_TLS_CERT``/``_KEY``)
    or a bearer token (``token``, ``token_file``; ``SHARDCAST_TOKEN``, ``SHARDCAST_TOKEN_FILE``;
    created with ``shardcast certs token``), over TLS checked against the cluster CA (``ca``;
    ``SHARDCAST_TLS_CA``). Roles: ``read`` may query and watch, ``platform`` may also prewarm,
    scale out and report load, ``admin`` may also register and evict.
    """

    #: How long a call keeps trying while no controller replica takes it (seconds).
    failover_patience = 15.0

    def __init__(self, url=None, *, ca=None, cert=None, key=None, token=None, token_file=None, timeout=60.0):
        url = url or os.environ.get(ENV_CONTROLLER, DEFAULT_CONTROLLER)
        # Several controller replicas (a list, or comma-separated): calls follow the leader.
        urls = [u.strip() for u in (url.split(",") if isinstance(url, str) else url) if u.strip()]
        if not urls:
            raise errors.ShardcastError("no controller address given")
        self.url = ",".join(urls)
        self._eps = [Endpoint(u, ca=ca, cert=cert, key=key, token=token, token_file=token_file, timeout=timeout,
                              unavailable=errors.ControllerUnavailable, what="controller") for u in urls]
        self._current = 0

    @property
    def _ep(self):
        return self._eps[self._current]

    def __repr__(self):
        return f"shardcast.Client({self.url!r})"

    def _call(self, method, path, body=None, query=None, model_route=False):
        not_found = errors.UnknownModel if model_route else errors.NotFound
        if len(self._eps) == 1:
            return self._ep.call(method, path, body=body, query=query, not_found=not_found)
        # A follower refuses writes with 503 and names the leader; a dead replica does not
        # answer. Follow the hint, else try the next replica, for at most failover_patience.
        deadline = time.monotonic() + self.failover_patience
        misses = 0
        while True:
            i = self._current
            try:
                return self._eps[i].call(method, path, body=body, query=query, not_found=not_found)
            except errors.Unavailable as e:
                refusal = getattr(e, "not_leader", False)
                if e.status is not None and not refusal:
                    raise  # a 503 of the call itself (e.g. no live host)
                misses += 1
                if time.monotonic() >= deadline:
                    raise
                nxt = None
                leader = getattr(e, "leader", None) or {}
                for j, ep in enumerate(self._eps):
                    if j != i and leader.get("http") and ep.host and \
                            f"{ep.host}:{ep.port}" == leader.get("http"):
                        nxt = j
                if nxt is None:
                    nxt = (i + 1) % len(self._eps)
                    if misses % len(self._eps) == 0:
                        time.sleep(0.2)
                self._current = nxt

    # -- models ------------------------------------------------------------------------
    def healthy(self):
        try:
            self._call("GET", "/healthz")
            return True
        except errors.Unavailable:
            return False

    def register(self, name, origin, chunk_size=0, via_host="", profile=None):
        """Registers ``name`` from ``origin`` (``file:///dir``, ``https://host/prefix/``):
        a live transferd reads it and builds the manifest. Role ``admin``. Returns ModelInfo
        (``digest``, ``shards``, ``total_bytes``, ...)."""
        body = {"name": name, "origin": origin, "chunk_size": int(chunk_size), "via_host": via_host}
        if profile is not None:
            body["profile_json"] = profile if isinstance(profile, str) else json.dumps(profile)
        return self._call("POST", "/v1/models", body)

    def models(self):
        return self._call("GET", "/v1/models").get("models", [])

    def model(self, name):
        """ModelInfo of ``name`` (or a hex digest); :class:`UnknownModel` if not registered."""
        return self._call("GET", "/v1/models/" + _q(name), model_route=True)

    def status(self, name):
        """Where the model is: ``{"model": ModelInfo, "hosts": [HostHolding], "plans": [...]}``."""
        return self._call("GET", "/v1/status/" + _q(name), model_route=True)

    # -- placing models ------------------------------------------------------------------
    def prewarm(self, model, replicas=0, hosts=(), tier="memory", sources=""):
        """Makes ``replicas`` hosts (or exactly ``hosts``) hold ``model`` in ``tier``
        (``memory``, ``disk`` or ``gpu``). Role ``platform``. Returns PlanAccepted
        (``plan_id``, ``estimate_s``, ``chains``, ``hosts``); follow it with :meth:`watch` or
        :meth:`wait`."""
        body = {"model": model, "replicas": int(replicas), "hosts": list(hosts), "tier": tier}
        if sources:
            body["sources"] = sources
        return self._call("POST", "/v1/prewarm", body, model_route=True)

    def scale_out(self, model, replicas, tier="memory", partitions=0):
        """Adds ``replicas`` replicas beyond those that exist; ``partitions`` > 1 (tier
        ``gpu``) makes a partitioned burst. Role ``platform``. Returns PlanAccepted."""
        body = {"model": model, "replicas": int(replicas), "tier": tier, "partitions": int(partitions)}
        return self._call("POST", "/v1/scale-out", body, model_route=True)

    def evict(self, model, hosts=(), tier="memory"):
        """Removes copies of ``model`` in ``tier`` (all holders when ``hosts`` is empty).
        Role ``admin``. Returns the hosts evicted from."""
        body = {"model": model, "hosts": list(hosts), "tier": tier}
        return self._call("POST", "/v1/evict", body, model_route=True).get("evicted", [])

    def report_load(self, model, arrival_rate, service_rate, queue_len=0, tier=""):
        """Reports the load the FaaS sees; the autoscaler decides on it. Role ``platform``.
        Returns the decision."""
        body = {"model": model, "arrival_rate": float(arrival_rate), "service_rate": float(service_rate),
                "queue_len": int(queue_len), "tier": tier}
        return self._call("POST", "/v1/load", body, model_route=True).get("decision", {})

    def partition_plan(self, model, max_partitions=0, gpu_memory=0, queue=0):
        """The model's partition-plan table (JSON)."""
        body = {"model": model, "max_partitions": int(max_partitions), "gpu_memory": int(gpu_memory),
                "queue": int(queue)}
        return self._call("POST", "/v1/partition-plan", body, model_route=True)

    # -- plans, hosts, events --------------------------------------------------------------
    def plans(self):
        return self._call("GET", "/v1/plans").get("plans", [])

    def plan(self, plan_id):
        """PlanStatus of a plan (``state``: running, done, partial or failed; ``hosts``:
        per-host progress)."""
        return self._call("GET", "/v1/plans/" + _q(plan_id))

    def hosts(self):
        return self._call("GET", "/v1/hosts").get("hosts", [])

    def events(self, model=""):
        return self._call("GET", "/v1/events", query={"model": model} if model else None).get("events", [])

    def metrics(self):
        return self._call("GET", "/metrics")

    def watch(self, plan_id, timeout=None):
        """Yields the plan's PlanStatus at once and on every change, until it ends
        (``state`` ``done``, ``partial`` or ``failed``) or ``timeout`` seconds pass
        (:class:`TimeoutError`)."""
        if isinstance(plan_id, dict):
            plan_id = plan_id["plan_id"]
        # One socket timeout for the whole stream: a quiet plan is not an error.
        r = self._ep.open("GET", "/v1/plans/" + _q(plan_id) + "/watch", timeout=timeout)
        try:
            if r.status != 200:
                raise self._ep.error(r.status, r.read())
            while True:
                try:
                    line = r.readline()
                except (socket.timeout, TimeoutError) as e:
                    raise TimeoutError(f"plan {plan_id} did not end within {timeout} s") from e
                if not line:
                    return
                line = line.strip()
                if not line:
                    continue
                doc = json.loads(line)
                if isinstance(doc, dict) and "error" in doc and "plan_id" not in doc:
                    e = doc["error"]
                    raise errors.ApiError(f"controller: watching plan {plan_id}: {e.get('message')}",
                                          code=e.get("code"))
                yield doc
                if doc.get("state") in ENDED:
                    return
        finally:
            r.close()

    def wait(self, plan, timeout=600.0, progress=None):
        """Waits for a plan (a PlanAccepted dict or a plan id) to end and returns its final
        PlanStatus; :class:`PlanFailed` if it failed, :class:`PlanPartial` (a PlanFailed)
        if it ended with some requested hosts short of a verified copy. ``progress`` is a callable given every
        PlanStatus, or ``True`` for a one-line progress display on stderr."""
        plan_id = plan["plan_id"] if isinstance(plan, dict) else plan
        show = _print_progress if progress is True else progress
        deadline = None if timeout is None else time.monotonic() + timeout
        last = None
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"plan {plan_id} did not end within {timeout} s (last state: "
                                   f"{(last or {}).get('state')})")
            for st in self.watch(plan_id, timeout=left):
                last = st
                if show:
                    show(st)
            if last is not None and last.get("state") in ENDED:
                break
            # The stream ended early (a controller restart, say): look, then watch again.
            last = self.plan(plan_id)
            if last.get("state") in ENDED:
                break
            time.sleep(0.2)
        if progress is True:
            sys.stderr.write("\n")
        if last.get("state") == "failed":
            raise errors.PlanFailed(f"plan {plan_id} failed: {last.get('message', '')}", last)
        if last.get("state") == "partial":
            short = [h for h in last.get("hosts", []) if h.get("state") not in ("done", "local")]
            names = ", ".join(f"{h.get('host')} ({h.get('state')})" for h in short)
            raise errors.PlanPartial(
                f"plan {plan_id} ended partial: {len(short)} of {len(last.get('hosts', []))} hosts "
                f"without a verified copy: {names}", last, short)
        return last


def plan_progress(st):
    """``(bytes done, bytes total)`` over a PlanStatus's receivers."""
    done = sum(int(h.get("bytes", 0)) for h in st.get("hosts", []))
    total = sum(int(h.get("total", 0)) for h in st.get("hosts", []))
    return done, total


def _print_progress(st):
    done, total = plan_progress(st)
    pct = 100.0 * done / total if total else 0.0
    states = ",".join(f"{h.get('host')}:{h.get('state')}" for h in st.get("hosts", []))
    sys.stderr.write(f"\rplan {st.get('plan_id')} {st.get('state')} {pct:5.1f}% "
                     f"({done}/{total} B) {states}\x1b[K")
    sys.stderr.flush()
