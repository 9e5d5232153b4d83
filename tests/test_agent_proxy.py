"""The agent's TUF downloads honour HTTP_PROXY / HTTPS_PROXY / NO_PROXY as its bootstrap and enrollment do.

A real HTTP proxy on loopback (absolute-URI GET and CONNECT tunnels) records what it carries; the fleet stands
in as plain HTTP and HTTPS servers on loopback. Before, the fetcher (http.client) went straight to the fleet
whatever the environment said, so a box that reaches its fleet only through a proxy bootstrapped and enrolled
and then never downloaded a model.
"""

from __future__ import annotations

import base64
import datetime as dt
import http.client
import http.server
import ipaddress
import select
import socket
import ssl
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tuf.api import exceptions as tuf_exc

from edgefleet.agent.link.updater import GuardedFetcher
from tests.conftest import free_port

BODY = b'{"signed": "a metadata file, as the fleet serves it"}' * 50
PROXY_VARS = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY", "all_proxy",
              "ALL_PROXY")


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def _serve(handler: type, context: ssl.SSLContext | None = None) -> tuple[int, http.server.ThreadingHTTPServer]:
    port = free_port()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    srv.daemon_threads = True
    if context is not None:
        srv.socket = context.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return port, srv


class _Fleet(_Quiet):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)


class Proxy:
    """A forwarding proxy: what it carried is in ``seen`` as (method, target, Proxy-Authorization)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []
        proxy = self

        class Handler(_Quiet):
            def do_GET(self) -> None:
                proxy.seen.append(("GET", self.path, self.headers.get("Proxy-Authorization")))
                u = urllib.request.urlparse(self.path)
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
                conn.request("GET", u.path)
                r = conn.getresponse()
                body = r.read(10 * 2**20)
                self.send_response(r.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                conn.close()

            def do_CONNECT(self) -> None:
                proxy.seen.append(("CONNECT", self.path, self.headers.get("Proxy-Authorization")))
                host, _, port = self.path.rpartition(":")
                upstream = socket.create_connection((host, int(port)), timeout=10)
                self.send_response(200, "Connection established")
                self.end_headers()
                ends = [self.connection, upstream]
                try:
                    while True:  # relay both ways until either side closes (each read bounded by the timeout)
                        ready, _, _ = select.select(ends, [], [], 10)
                        if not ready:
                            return
                        for s in ready:
                            data = s.recv(65536)
                            if not data:
                                return
                            (upstream if s is self.connection else self.connection).sendall(data)
                finally:
                    upstream.close()

        self.port, self.server = _serve(Handler)


@pytest.fixture
def env(monkeypatch) -> Iterator[pytest.MonkeyPatch]:
    import urllib.request

    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    # urlopen builds its opener, proxies included, from the environment at its first call in the process and keeps
    # it: a test that set *_PROXY after an earlier test's urlopen would not be heard (seen on the 3.10 pass)
    urllib.request.install_opener(None)
    yield monkeypatch
    urllib.request.install_opener(None)


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    p = Proxy()
    yield p
    p.server.shutdown()


@pytest.fixture
def fleet_http() -> Iterator[str]:
    port, srv = _serve(_Fleet)
    yield f"http://127.0.0.1:{port}/metadata/timestamp.json"
    srv.shutdown()


def _fetch(url: str) -> bytes:
    return b"".join(GuardedFetcher(socket_timeout_s=10).fetch(url))


def _bootstrap_get(url: str) -> bytes:
    """What the agent's bootstrap and enrollment do (agent/daemon.py, agent/link/enroll.py)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def test_downloads_go_through_the_proxy_that_http_proxy_names_as_bootstrap_does(env, proxy, fleet_http):
    env.setenv("HTTP_PROXY", f"http://agent%40site:s3cret@127.0.0.1:{proxy.port}")
    assert _bootstrap_get(fleet_http) == BODY
    assert _fetch(fleet_http) == BODY
    auth = "Basic " + base64.b64encode(b"agent@site:s3cret").decode()
    assert proxy.seen == [("GET", fleet_http, auth), ("GET", fleet_http, auth)]


def test_hosts_no_proxy_lists_are_fetched_directly(env, proxy, fleet_http):
    env.setenv("http_proxy", f"127.0.0.1:{proxy.port}")  # lower case, no scheme: urllib takes both
    env.setenv("NO_PROXY", "localhost,127.0.0.1")
    assert _bootstrap_get(fleet_http) == BODY
    assert _fetch(fleet_http) == BODY
    assert proxy.seen == []
    env.setenv("NO_PROXY", "example.org")  # another host listed: this one goes through the proxy again
    assert _fetch(fleet_http) == BODY
    assert [m for m, _, _ in proxy.seen] == ["GET"]


def _tls(d: Path) -> tuple[ssl.SSLContext, Path, Path]:
    """A server context for 127.0.0.1 signed by a CA made here; the CA's file, and another CA's file."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.timezone.utc)

    def cert(cn: str, key, issuer_key, issuer: x509.Name | None, ca: bool) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        b = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
             .not_valid_after(now + dt.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    pem = serialization.Encoding.PEM
    files = {}
    for stem in ("ca", "other-ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = cert(f"edgefleet proxy test {stem}", key, key, None, True)
        files[stem] = (key, ca_cert)
        (d / f"{stem}.pem").write_bytes(ca_cert.public_bytes(pem))
    ca_key, ca_cert = files["ca"]
    key = ec.generate_private_key(ec.SECP256R1())
    (d / "server.pem").write_bytes(cert("127.0.0.1", key, ca_key, ca_cert.subject, False).public_bytes(pem))
    (d / "server.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "server.pem", d / "server.key")
    return ctx, d / "ca.pem", d / "other-ca.pem"


def test_https_downloads_are_tunnelled_and_still_check_the_fleets_certificate(env, proxy, tmp_path):
    ctx, ca, other_ca = _tls(tmp_path)
    port, srv = _serve(_Fleet, ctx)
    url = f"https://127.0.0.1:{port}/targets/bundle.tar"
    try:
        env.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.port}")
        env.setenv("SSL_CERT_FILE", str(ca))  # the box trusts the fleet's CA (read by ssl's default context)
        assert _fetch(url) == BODY
        assert proxy.seen == [("CONNECT", f"127.0.0.1:{port}", None)]
        # the tunnel carries TLS end to end: a fleet certificate the box does not trust is still refused
        env.setenv("SSL_CERT_FILE", str(other_ca))
        with pytest.raises(tuf_exc.DownloadError, match="CERTIFICATE_VERIFY_FAILED"):
            _fetch(url)
        assert len(proxy.seen) == 2
    finally:
        srv.shutdown()


def test_a_proxy_the_fetcher_cannot_use_is_one_clear_error(env, fleet_http):
    env.setenv("HTTP_PROXY", "socks5://127.0.0.1:1080")
    with pytest.raises(tuf_exc.DownloadError, match=r"not an http:// proxy .* fix HTTP_PROXY or list the fleet "
                                                    r"in NO_PROXY"):
        _fetch(fleet_http)
