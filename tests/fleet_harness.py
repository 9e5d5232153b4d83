"""Run a real fleet server (uvicorn on loopback) in a thread of the test process."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from edgefleet.fleet.app import FleetConfig, FleetServer
from edgefleet.fleet.keys import init_keys
from tests.conftest import free_port
from tests.waiting import wait_for


class Api:
    """httpx's module functions with the running fleet's admin token (``token=None`` sends none)."""

    def __init__(self) -> None:
        self.token: str | None = None

    def request(self, method: str, url: str, token: str | bool | None = True, **kw: object) -> httpx.Response:
        tok = self.token if token is True else (token or None)
        headers = dict(kw.pop("headers", None) or {})  # type: ignore[call-overload]
        if tok:
            headers["Authorization"] = f"Bearer {tok}"
        return httpx.request(method, url, headers=headers, timeout=30, **kw)  # type: ignore[arg-type]

    def get(self, url: str, **kw: object) -> httpx.Response:
        return self.request("GET", url, **kw)  # type: ignore[arg-type]

    def post(self, url: str, **kw: object) -> httpx.Response:
        return self.request("POST", url, **kw)  # type: ignore[arg-type]

    def patch(self, url: str, **kw: object) -> httpx.Response:
        return self.request("PATCH", url, **kw)  # type: ignore[arg-type]

    def delete(self, url: str, **kw: object) -> httpx.Response:
        return self.request("DELETE", url, **kw)  # type: ignore[arg-type]


api = Api()


@contextmanager
def running_fleet(tmp: Path, mqtt_url: str | None, db_url: str | None = None,
                  **config: object) -> Iterator[tuple[FleetServer, str]]:
    if not (tmp / "keys" / "root.json").exists():
        init_keys(tmp / "keys")
    # the HTTP socket is bound here and handed to uvicorn: a port found free and bound later could be taken
    # in between (the fleet's own connection to its embedded broker gets an ephemeral port from the same range)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    cfg = FleetConfig(data_dir=tmp / "fleet", keys_dir=tmp / "keys", port=port, mqtt_url=mqtt_url, db_url=db_url,
                      embedded_mqtt_port=free_port(), **config)  # type: ignore[arg-type]
    fs = FleetServer(cfg)
    api.token = (cfg.data_dir / "admin-token").read_text().strip()
    fs.start_background()
    server = fs.http_server()  # the fleet's own: its protocol and connection limits
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{url}/api/v1/health", timeout=1).json()["mqtt_connected"], 20,
                 "the fleet up and connected to its broker", retry_on=(httpx.TransportError,))
        yield fs, url
    finally:
        server.should_exit = True
        t.join(10)
        fs.stop_background()
        sock.close()


class RecordingPublisher:
    """What the fleet would publish, kept by topic: the publisher a RolloutDriver or FleetService gets in tests
    that drive them without a broker."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def publish(self, topic: str, payload: bytes, retain: bool) -> None:
        self.sent.append(topic)


@contextmanager
def fleet_with_digits(tmp: Path, mqtt_url: str, db_url: str | None, bundle: Path, device):
    """A fleet with digits 1.0.0 uploaded and ``device()``'s MQTT client (anything with a paho ``.c``), closed
    after: the fixture of the tests that publish as devices."""
    with running_fleet(tmp, mqtt_url, rollout_tick_s=0.05, db_url=db_url) as (fs, url):
        assert api.post(f"{url}/api/v1/bundles", content=bundle.read_bytes()).status_code == 201
        dev = device()
        try:
            yield fs, url, dev
        finally:
            dev.c.loop_stop()
            dev.c.disconnect()

