#!/usr/bin/env python3
"""What a FaaS does with shardcast before it starts function replicas: ask the controller
for copies of a model on N hosts, follow the plan to its end, and read where the copies are.

    python3 examples/python/faas_client.py --controller https://ctl.internal:7501 \
        --ca /etc/shardcast/pki/ca.pem --token-file /run/secrets/shardcast-token \
        --model org/llama-3-8b --replicas 4
    python3 examples/python/faas_client.py ... --scale-out --replicas 2   # 2 more replicas
    python3 examples/python/faas_client.py ... --tier gpu --json          # JSON on stdout

Standard library only (urllib, ssl, json), over the controller's HTTP/JSON API
(docs/OPERATIONS.md, "HTTP/JSON API"; docs/openapi.json):

  1. GET  /v1/models                  the registered models (role read)
  2. POST /v1/prewarm                 {"model", "replicas", "tier"} -> PlanAccepted (role platform)
     or POST /v1/scale-out            {"model", "replicas", "tier"}: that many more replicas
  3. GET  /v1/plans/{id}/watch        one PlanStatus per line, on every change, until the
                                      plan ends (done, partial or failed)
  4. GET  /v1/status/{model}          which hosts hold a verified copy, per tier

It authenticates with a bearer token (`shardcast certs token --role platform --name NAME`;
its `tokens-file line` goes into the controller's --tokens-file) over HTTPS, checking the
controller's certificate against the cluster CA. The token comes from --token,
--token-file, or $SHARDCAST_TOKEN / $SHARDCAST_TOKEN_FILE. This script speaks HTTP only: for
the gRPC API with a client certificate use the `shardcast` CLI or stubs generated from
protocol/proto/controller.proto (docs/INTEGRATION.md).

Exit status, as the `shardcast` CLI's: 0 the plan ended `done` (every host it was asked for
holds a verified copy); 7 it ended `partial`; 6 it ended `failed`; 2 invalid arguments
(HTTP 400); 3 unknown model (404); 4 not enough live hosts with room (507); 5 the
controller unreachable, or unavailable (503: no live host); 1 anything else, a refused
token (401/403) included.
"""

import argparse
import http.client
import json
import os
import socket
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

ENDED = ("done", "partial", "failed")
EXIT_BY_STATUS = {400: 2, 404: 3, 507: 4, 503: 5}


class Failure(Exception):
    """An error to report on stderr, with the exit status to end with."""

    def __init__(self, message, exit_code=1):
        super().__init__(message)
        self.exit_code = exit_code


class Controller:
    """The controller's HTTP/JSON API at ``url`` with a bearer token."""

    def __init__(self, url, ca, token, timeout=30.0):
        u = urllib.parse.urlsplit(url)
        if u.scheme != "https" or not u.hostname:
            raise Failure(f"--controller {url!r}: expected https://HOST:PORT (the controller's --http-listen)", 2)
        self.base = f"https://{u.netloc}"
        self.token = token
        self.timeout = timeout
        # The cluster CA: the controller presents a certificate it signed (naming localhost
        # and the loopback addresses by default, more with `shardcast certs issue --dns/--ip`).
        self.ctx = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
        self.ctx.minimum_version = ssl.TLSVersion.TLSv1_3

    def open(self, method, path, body=None, timeout=None):
        data = None
        headers = {"Accept": "application/json", "Authorization": f"Bearer {self.token}"}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.timeout, context=self.ctx)
        except urllib.error.HTTPError as e:
            raise self.refusal(method, path, e) from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, ssl.SSLCertVerificationError):
                raise Failure(f"the controller at {self.base} presented a certificate that does not verify "
                              f"against the CA given ({reason.verify_message}): pass the cluster CA with --ca", 5)
            raise Failure(f"the controller at {self.base} is not reachable: {reason}", 5)
        except (socket.timeout, TimeoutError, ConnectionError) as e:
            raise Failure(f"the controller at {self.base} did not answer: {e}", 5)

    def call(self, method, path, body=None):
        with self.open(method, path, body) as r:
            return json.loads(r.read() or b"{}")

    def refusal(self, method, path, e):
        """A Failure for an error answer: `{"error": {"code", "message"}}` and its status."""
        raw = e.read()
        code, message = None, raw.decode("utf-8", "replace").strip()
        try:
            err = json.loads(raw).get("error", {})
            code, message = err.get("code"), err.get("message", message)
        except (ValueError, AttributeError):
            pass
        what = f"{method} {path}: {e.code} {code or e.reason}: {message}"
        if e.code == 401:
            what += " (the controller does not know this token: check --token/--token-file, and that its " \
                    "`tokens-file line` is in the controller's --tokens-file)"
        elif e.code == 403:
            what += " (the token's role may not do this: prewarm and scale-out need role platform or admin)"
        return Failure(what, EXIT_BY_STATUS.get(e.code, 1))

    # -- the four calls ---------------------------------------------------------------------
    def models(self):
        return self.call("GET", "/v1/models").get("models", [])

    def place(self, model, replicas, tier, scale_out):
        route = "/v1/scale-out" if scale_out else "/v1/prewarm"
        return self.call("POST", route, {"model": model, "replicas": replicas, "tier": tier})

    def watch(self, plan_id, timeout):
        """Yields the plan's PlanStatus on every change until it ends; a stream that ends
        early (a controller restart, a fail-over) is resumed after a look at the plan."""
        deadline = time.monotonic() + timeout
        path = "/v1/plans/" + urllib.parse.quote(plan_id, safe="")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failure(f"plan {plan_id} did not end within {timeout:g} s")
            try:
                with self.open("GET", path + "/watch", timeout=left) as r:
                    for line in r:
                        line = line.strip()
                        if not line:
                            continue
                        doc = json.loads(line)
                        if "error" in doc and "plan_id" not in doc:
                            raise Failure(f"watching plan {plan_id}: {doc['error'].get('message')}")
                        yield doc
                        if doc.get("state") in ENDED:
                            return
            except (socket.timeout, TimeoutError):
                raise Failure(f"plan {plan_id} did not end within {timeout:g} s") from None
            except (OSError, http.client.HTTPException) as e:
                print(f"watch of plan {plan_id} broke ({e}); looking again", file=sys.stderr)
            st = self.call("GET", path)
            if st.get("state") in ENDED:
                yield st
                return
            time.sleep(0.5)

    def status(self, model):
        return self.call("GET", "/v1/status/" + urllib.parse.quote(model, safe="/"))


def read_token(args):
    if args.token:
        return args.token.strip()
    path = args.token_file or os.environ.get("SHARDCAST_TOKEN_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                words = f.read().split()
        except OSError as e:
            raise Failure(f"token file {path}: {e.strerror}", 2)
        if not words:
            raise Failure(f"token file {path} is empty", 2)
        return words[0]
    if os.environ.get("SHARDCAST_TOKEN"):
        return os.environ["SHARDCAST_TOKEN"].strip()
    raise Failure("no token: give --token, --token-file, $SHARDCAST_TOKEN or $SHARDCAST_TOKEN_FILE "
                  "(`shardcast certs token --role platform --name NAME` makes one)", 2)


def size(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def progress_line(st):
    done = sum(int(h.get("bytes", 0)) for h in st.get("hosts", []))
    total = sum(int(h.get("total", 0)) for h in st.get("hosts", []))
    pct = 100.0 * done / total if total else 100.0
    hosts = " ".join(f"{h.get('host')}:{h.get('state')}" for h in st.get("hosts", []))
    return f"plan {st.get('plan_id')} {st.get('state')} {pct:5.1f}% {hosts}"


def run(args):
    ctl = Controller(args.controller, args.ca, read_token(args), timeout=args.request_timeout)
    out = sys.stderr if args.json else sys.stdout

    models = ctl.models()
    print(f"{len(models)} model(s) registered:", file=out)
    for m in models:
        print(f"  {m.get('name')}  {m.get('digest', '')[:16]}  {size(m.get('total_bytes', 0))}", file=out)
    if not any(args.model in (m.get("name"), m.get("digest")) for m in models):
        raise Failure(f"{args.model} is not registered: an admin registers it first "
                      f"(`shardcast register {args.model} ORIGIN`, or POST /v1/models)", 3)

    verb = "scale-out" if args.scale_out else "prewarm"
    accepted = ctl.place(args.model, args.replicas, args.tier, args.scale_out)
    plan_id = accepted["plan_id"]
    print(f"{verb} {args.model} x{args.replicas} ({args.tier}): plan {plan_id}, "
          f"estimate {accepted.get('estimate_s', 0):.1f} s", file=out)
    for c in accepted.get("chains", []):
        print(f"  chain {c.get('source')} ({c.get('source_tier')}) -> {' -> '.join(c.get('hops', []))}", file=out)

    final = None
    for st in ctl.watch(plan_id, args.timeout):
        final = st
        print(progress_line(st), file=out)

    status = ctl.status(args.model)
    total = int(status.get("model", {}).get("total_bytes", 0))
    print(f"copies of {args.model} ({size(total)}):", file=out)
    for h in sorted(status.get("hosts", []), key=lambda h: h.get("host", "")):
        tiers = [t for t in ("memory", "disk") if h.get(t)] + ([f"gpu x{h['gpus']}"] if h.get("gpus") else [])
        print(f"  {h.get('host')}  {'up' if h.get('up') else 'DOWN'}  {', '.join(tiers) or 'partial'}", file=out)

    if args.json:
        json.dump({"accepted": accepted, "plan": final, "status": status}, sys.stdout, indent=2)
        sys.stdout.write("\n")

    state = final.get("state")
    if state == "done":
        return 0
    short = [f"{h.get('host')} ({h.get('state')}: {h.get('error', '')})" for h in final.get("hosts", [])
             if h.get("state") not in ("done", "local")]
    print(f"plan {plan_id} ended {state}: {final.get('message', '')}; without a verified copy: "
          f"{', '.join(short) or 'none listed'}", file=sys.stderr)
    return 7 if state == "partial" else 6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--controller", default=os.environ.get("SHARDCAST_CONTROLLER_URL", "https://127.0.0.1:7501"),
                   help="the controller's HTTP API, https://HOST:PORT ($SHARDCAST_CONTROLLER_URL)")
    p.add_argument("--ca", default=os.environ.get("SHARDCAST_TLS_CA"),
                   help="the cluster CA (PEM) the controller's certificate must chain to ($SHARDCAST_TLS_CA)")
    p.add_argument("--token", help="bearer token (shc_...); prefer --token-file")
    p.add_argument("--token-file", help="file holding the bearer token")
    p.add_argument("--model", required=True, help="model name (or digest), e.g. org/llama-3-8b")
    p.add_argument("--replicas", type=int, required=True,
                   help="hosts that should hold the model (with --scale-out: how many more)")
    p.add_argument("--tier", default="memory", choices=("memory", "disk", "gpu"))
    p.add_argument("--scale-out", action="store_true", help="POST /v1/scale-out instead of /v1/prewarm")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the plan to end")
    p.add_argument("--request-timeout", type=float, default=30.0, help="seconds for each other request")
    p.add_argument("--json", action="store_true",
                   help="print {accepted, plan, status} as JSON on stdout (progress goes to stderr)")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    try:
        return run(args)
    except Failure as e:
        print(f"faas_client: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
