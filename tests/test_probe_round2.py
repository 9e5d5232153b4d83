"""A fresh outside probe of issue 30's bounds (values, work, owners), with shapes the issue did not list.

Each test acts as one party from outside: an enrolled device publishing on a real broker, an operator over the REST
API, a second local user on the agent's box. Real parts throughout (Mosquitto, the fleet on loopback, SQLite and
PostgreSQL).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from edgefleet.protocol import mqtt as proto
from tests.conftest import postgres_db, wait_for
from tests.fleet_harness import api, fleet_with_digits
from tests.test_trust_values import _device, _online, _rejected, _reported, _telemetry


@pytest.fixture(params=["sqlite", "postgresql"])
def probe_db(request) -> str | None:
    if request.param == "sqlite":
        return None
    url = postgres_db("edgefleet_probe_round2")  # its own database: other tests recreate theirs concurrently
    if url is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432: the SQLite run covers the same code")
    return url


@pytest.fixture
def fleet(tmp_path, mosquitto, probe_db, digits_bundle) -> Iterator[tuple[object, str, object]]:
    with fleet_with_digits(tmp_path, mosquitto.url, probe_db, digits_bundle, lambda: _device(mosquitto.port)) as f:
        yield f


def _failed(url: str) -> dict[str, int]:
    return {k: v for k, v in _rejected(url).items() if k.startswith("ingest_failed") or k == "ingest_error"}


def test_probe_nul_and_edge_values_from_a_device(fleet):
    """NUL characters in a report's free strings, rollout ids at and past int32, a telemetry model name with NUL,
    duplicate keys: each refused in one line or stored, never a failed store, and a healthy device beside them is
    stored."""
    fs, url, dev = fleet
    _online(url, dev, "edge-bad", "edge-ok")
    bad = [
        json.dumps({"v": 1, "device_id": "edge-bad", "ts": time.time(), "kind": "reported", "state": "failed",
                    "rollout_id": None, "model": "digits\x00", "version": "1.0.0", "running_model": "x\x00y",
                    "running_version": "1.0.0", "error": "boom\x00"}).encode(),
        _reported("edge-bad", 2**31, ts=time.time() + 1),
        _reported("edge-bad", 2**62 - 1, ts=time.time() + 2),
    ]
    for p in bad:
        dev.publish(proto.topic("edge-bad", "reported"), p)
    dev.publish(proto.topic("edge-bad", "telemetry"), _telemetry("edge-bad", 0, 1, model="digits\x00"))
    dup = _telemetry("edge-bad", 1, 1)[:-1] + b',"requests":1099511627776}'  # the last "requests" past MAX_COUNT
    dev.publish(proto.topic("edge-bad", "telemetry"), dup)
    dev.publish(proto.topic("edge-ok", "reported"), _reported("edge-ok", None))
    dev.publish(proto.topic("edge-ok", "telemetry"), _telemetry("edge-ok", 0, 5))
    wait_for(lambda: fs.service.devices.telemetry_count("edge-ok") == 1, 20, "the healthy record stored")
    wait_for(lambda: api.get(f"{url}/api/v1/devices/edge-ok").json().get("last_state") == "installed", 20,
             "the healthy report stored")
    wait_for(lambda: _rejected(url).get("report_not_a_target", 0) + _rejected(url).get("malformed_reported", 0)
             + sum(_failed(url).values()) >= 3, 20, "the three hostile reports handled")
    assert _failed(url) == {}, _rejected(url)
    assert _rejected(url).get("malformed_telemetry", 0) >= 1  # the duplicate key's last value is the one judged
    for path in ("/api/v1/devices", "/api/v1/devices/edge-bad", "/", "/devices/edge-bad"):
        r = api.get(url + path)
        assert r.status_code == 200, (path, r.status_code, r.text[:300])


def test_probe_operator_numbers_past_int32_and_nul_characters(fleet):
    """Ids past the database's 32-bit id columns and NUL characters in paths, queries and bodies: each answered
    with a 4xx (or an empty result), never a 500, on both databases."""
    fs, url, dev = fleet
    _online(url, dev, "edge-a")
    rid = 2**31
    bad = []
    for method, path, body in (
            ("GET", f"/api/v1/rollouts/{rid}", None), ("GET", f"/api/v1/rollouts/{rid}/drift", None),
            ("GET", f"/api/v1/rollouts/{rid}/audit", None), ("POST", f"/api/v1/rollouts/{rid}/abort", None),
            ("GET", f"/rollouts/{rid}", None), ("GET", "/api/v1/devices/edge%00a", None),
            ("GET", "/api/v1/devices/edge%00a/telemetry", None), ("GET", "/api/v1/devices/edge%00a/drift", None),
            ("GET", "/devices/edge%00a", None), ("GET", "/api/v1/devices?q=a%00b", None),
            ("GET", "/api/v1/devices?group=a%00b", None), ("GET", "/api/v1/devices?state=a%00b", None),
            ("GET", "/api/v1/rollouts/1?targets_state=a%00b", None),
            ("POST", "/api/v1/devices", {"device_id": "edge-n", "labels": {"site": "a\x00b"}}),
            ("POST", "/api/v1/devices", {"device_id": "edge-n2", "tags": ["a\x00b"]}),
            ("PATCH", "/api/v1/devices/edge-a", {"labels": {"k\x00": "v"}}),
            ("POST", "/api/v1/rollouts", {"model": "digits\x00", "version": "1.0.0", "devices": ["edge-a"]}),
            ("POST", "/api/v1/rollouts", {"model": "digits", "version": "1.0.0", "devices": ["edge\x00a"]}),
            ("POST", "/api/v1/rollouts", {"model": "digits", "version": "1.0.0", "group": "g\x00"}),
            ("POST", "/api/v1/tokens", {"name": "t\x00", "role": "viewer"}),
            ("DELETE", "/api/v1/tokens/t%00", None),
            ("POST", f"/console/rollouts/{rid}/abort", None)):
        headers = {"Origin": url} if path.startswith("/console") else {}
        r = api.request(method, url + path, json=body, headers=headers) if body is not None else \
            api.request(method, url + path, headers=headers)
        if r.status_code >= 500:
            bad.append((method, path, body, r.status_code, r.text[:100]))
    assert bad == [], '\n'.join(map(str, bad))
    assert api.get(f"{url}/api/v1/devices").status_code == 200


# -- a second local user on the agent's box ---------------------------------------------------------------------
def _register_from(uid: int, source: str, port: int, region: str, key: str, out) -> None:
    """In a child process: drop to ``uid``, register ``region`` over loopback TCP from the source address ``source``
    (any of 127.0.0.0/8 reaches a listener on 127.0.0.1), put the status."""
    import os
    import socket
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        body = json.dumps({"key": key, "offset": 0, "byte_size": 4096}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=20, source_address=(source, 0)) as s:
            s.sendall(f"POST /v2/systemsharedmemory/region/{region}/register HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        out.put(int(data.split(b" ", 2)[1]))
    except BaseException as exc:
        out.put(repr(exc))


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="a client of another user needs root to drop to nobody")
def test_probe_one_user_cannot_take_every_region_by_changing_its_source_address(tmp_path, digits_bundle):
    """max_shm_regions_per_client counts a local user's regions apart from another's; a user that connects from
    127.0.0.2, .3, ... (every one reaches the loopback listener) is still one user, and cannot take every region
    of the agent's registry from the others."""
    import multiprocessing
    import os
    import uuid
    from multiprocessing import shared_memory

    from tests.agent_harness import preinstall, running_agent

    nobody = 65534
    name = f"edgefleet-probe2-{uuid.uuid4().hex[:12]}"
    obj = shared_memory.SharedMemory(name, create=True, size=4096)
    try:
        os.chmod(f"/dev/shm/{name}", 0o644)  # nobody may read it: its registrations are allowed one by one
        data = tmp_path / "agent"
        data.mkdir()
        preinstall(data, digits_bundle)
        with running_agent(data, max_shm_regions_per_client=2, max_shm_regions=8) as (a, url):
            port = int(url.rsplit(":", 1)[1])
            ctx = multiprocessing.get_context("fork")
            got = []
            for i in range(8):
                out = ctx.Queue()
                p = ctx.Process(target=_register_from, args=(nobody, f"127.0.0.{2 + i // 2}", port, f"n{i}", "/" + name,
                                                           out))
                p.start()
                got.append(out.get(timeout=60))
                p.join(30)
            assert got.count(200) <= 2, f"one user (nobody) registered {got.count(200)} regions: {got}"
            r = __import__("httpx").post(f"{url}/v2/systemsharedmemory/region/mine/register",
                                         json={"key": "/" + name, "offset": 0, "byte_size": 4096}, timeout=20)
            assert r.status_code == 200, r.text
    finally:
        obj.close()
        obj.unlink()
