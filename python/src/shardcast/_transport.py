"""HTTP(S) and Unix-socket requests to shardcast's HTTP APIs (standard library only).

Secure modes, as the services accept them (docs/SECURITY.md):

* HTTPS with the cluster CA (``ca``) and a client certificate (``cert``/``key``) of a role
  that may call the route;
* HTTPS with the cluster CA and a bearer token (``token``, or ``token_file``);
* a Unix socket (transferd's ``admin_listen = "unix:/path"``): the daemon decides by the
  caller's uid, no TLS.

Plain ``http://`` exists only for daemons started with ``insecure_plaintext`` on loopback.
"""

import http.client
import json
import os
import socket
import ssl
import urllib.parse

from . import errors

ENV_CA = "SHARDCAST_TLS_CA"
ENV_CERT = "SHARDCAST_TLS_CERT"
ENV_KEY = "SHARDCAST_TLS_KEY"
ENV_TOKEN = "SHARDCAST_TOKEN"
ENV_TOKEN_FILE = "SHARDCAST_TOKEN_FILE"


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self._socket_path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._socket_path)
        except BaseException:
            s.close()
            raise
        self.sock = s


def _read_token(token, token_file):
    if token:
        return token.strip()
    path = token_file or os.environ.get(ENV_TOKEN_FILE)
    if path:
        with open(path, encoding="utf-8") as f:
            t = f.read().strip()
        if not t:
            raise errors.ShardcastError(f"token file {path} is empty")
        return t.split()[0]
    t = os.environ.get(ENV_TOKEN)
    return t.strip() if t else None


class Endpoint:
    """One HTTP service: ``https://host:port``, ``http://host:port`` (insecure plaintext),
    or ``unix:/path/to.sock``. ``unavailable`` is the exception class for a service that
    cannot be reached."""

    def __init__(self, address, *, ca=None, cert=None, key=None, token=None, token_file=None,
                 timeout=30.0, unavailable=errors.Unavailable, what="service"):
        self.address = address
        self.timeout = timeout
        self.unavailable = unavailable
        self.what = what
        self.token = _read_token(token, token_file)
        self.has_identity = bool(self.token or cert or os.environ.get(ENV_CERT))
        if address.startswith("unix:"):
            self.unix = address[len("unix:"):]
            self.scheme = "unix"
            self.host = self.port = None
            self._ctx = None
            return
        self.unix = None
        u = urllib.parse.urlsplit(address if "://" in address else "https://" + address)
        if u.scheme not in ("http", "https"):
            raise errors.ShardcastError(f"{what} address {address!r}: expected https://, http:// or unix:")
        self.scheme = u.scheme
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port
        self._ctx = None
        if self.scheme == "https":
            ca = ca or os.environ.get(ENV_CA)
            cert = cert or os.environ.get(ENV_CERT)
            key = key or os.environ.get(ENV_KEY)
            if cert and not key:
                raise errors.ShardcastError("a client certificate needs its key (key= or SHARDCAST_TLS_KEY)")
            # The cluster CA: every shardcast listener presents a certificate of it, naming
            # localhost and the loopback addresses by default (more with --dns/--ip).
            ctx = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            if cert:
                ctx.load_cert_chain(cert, key)
            self._ctx = ctx

    def _conn(self, timeout):
        if self.unix is not None:
            return _UnixHTTPConnection(self.unix, timeout)
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port or 443, timeout=timeout, context=self._ctx)
        return http.client.HTTPConnection(self.host, self.port or 80, timeout=timeout)

    def open(self, method, path, body=None, query=None, timeout=0):
        """Sends one request; returns the open response (status checked by the caller)."""
        if query:
            path = path + "?" + urllib.parse.urlencode(query, doseq=True)
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.token and self.scheme != "unix":
            headers["Authorization"] = f"Bearer {self.token}"
        conn = self._conn(self.timeout if timeout == 0 else timeout)
        try:
            conn.request(method, path, body=data, headers=headers)
            return conn.getresponse()
        except ssl.SSLCertVerificationError as e:
            conn.close()
            raise self.unavailable(
                f"{self.what} at {self.address}: its certificate does not verify against the CA "
                f"given ({e.verify_message}); pass the cluster CA (ca= or {ENV_CA})") from e
        except ssl.SSLError as e:
            conn.close()
            text = str(e).lower()
            if any(w in text for w in ("certificate", "unknown ca", "alert", "access denied")):
                raise errors.Unauthorized(
                    f"{self.what} at {self.address} refused the TLS handshake ({e.reason or e}): "
                    "a client certificate of the cluster CA, or a bearer token, is needed") from e
            raise self.unavailable(f"{self.what} at {self.address}: TLS failed: {e}") from e
        except (ConnectionError, FileNotFoundError, socket.timeout, socket.gaierror, OSError) as e:
            conn.close()
            raise self.unavailable(f"{self.what} at {self.address} is not reachable: {e}") from e

    def call(self, method, path, body=None, query=None, not_found=errors.NotFound):
        """One request; the decoded JSON answer (or text), or the matching exception."""
        r = self.open(method, path, body=body, query=query)
        try:
            raw = r.read()
        except (ConnectionError, socket.timeout, OSError) as e:
            raise self.unavailable(f"{self.what} at {self.address}: reading the answer failed: {e}") from e
        finally:
            r.close()
        if 200 <= r.status < 300:
            ctype = r.getheader("Content-Type", "")
            if "json" in ctype or raw[:1] in (b"{", b"["):
                return json.loads(raw)
            return raw.decode("utf-8", "replace")
        raise self.error(r.status, raw, not_found)

    def error(self, status, raw, not_found=errors.NotFound):
        """The exception for an error answer."""
        code = None
        doc = None
        message = raw.decode("utf-8", "replace").strip()
        try:
            doc = json.loads(raw)
            if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
                code = doc["error"].get("code")
                message = doc["error"].get("message", message)
        except ValueError:
            pass
        where = f"{self.what} at {self.address}"
        if status in (401, 403):
            hint = ""
            if status == 401:
                hint = (" (no identity: give a bearer token with token=/token_file= or "
                        f"{ENV_TOKEN}/{ENV_TOKEN_FILE}, or a client certificate)"
                        if not self.has_identity else " (the token or certificate was not accepted)")
            return errors.Unauthorized(f"{where} refused the request: {status} {message}{hint}",
                                       status=status, code=code)
        if status == 404:
            return not_found(f"{where}: {message}", status=status, code=code)
        if status == 400:
            return errors.InvalidRequest(f"{where}: {message}", status=status, code=code)
        if status == 409:
            return errors.NotReady(f"{where}: {message}", status=status, code=code)
        if status == 503:
            e = self.unavailable(f"{where}: {message}", status=status, code=code)
            # A controller replica that is not the leader names it (or null while none is).
            if isinstance(doc, dict) and "leader" in doc:
                e.not_leader = True
                e.leader = doc.get("leader")
            return e
        return errors.ApiError(f"{where}: {status} {message}", status=status, code=code)
