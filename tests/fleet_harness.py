"""Run a real fleet server (uvicorn on loopback) in a thread of the test process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from fleet.keys import init_keys
from fleet.server import FleetConfig, FleetServer
from tests.conftest import free_port


@contextmanager
def running_fleet(tmp: Path, mqtt_url: str | None, db_url: str | None = None,
                  **config: object) -> Iterator[tuple[FleetServer, str]]:
    if not (tmp / "keys" / "root.json").exists():
        init_keys(tmp / "keys")
    port = free_port()
    cfg = FleetConfig(data_dir=tmp / "fleet", keys_dir=tmp / "keys", port=port, mqtt_url=mqtt_url, db_url=db_url,
                      embedded_mqtt_port=free_port(), **config)  # type: ignore[arg-type]
    fs = FleetServer(cfg)
    fs.start_background()
    server = uvicorn.Server(uvicorn.Config(fs.app(), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=1).json()["mqtt_connected"]:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    else:
        raise TimeoutError("fleet did not come up")
    try:
        yield fs, url
    finally:
        server.should_exit = True
        t.join(10)
        fs.stop_background()
