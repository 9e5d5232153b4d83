"""Every answer the agent takes from its fleet is bounded in total time and bytes (agent/fetch.py), through a real
HTTP server on loopback that answers the way a hostile fleet, or anything in the path, could:

- a drip-fed answer (one byte every half second, for ever, in the body or in the head): it ends at its
  whole-answer deadline, not after a per-read timeout that each byte resets;
- an endless answer: it ends at its bound in bytes.

Against the real agent (its bootstrap loop) and the real TUF client (python-tuf with the agent's fetcher, over a
repository the fleet's own code signed): the attempt ends with one log line, a retry is scheduled with backoff,
and the model the agent serves keeps answering meanwhile.
"""

from __future__ import annotations

import http.server
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from edgefleet.agent.errors import FetchError
from edgefleet.agent.updater import BundleFetcher
from edgefleet.fleet.keys import KeyStore, init_keys
from edgefleet.fleet.tuf_repo import Repository
from edgefleet.protocol.bundle import sha256_file
from tests.agent_harness import installed_agent, served_version
from tests.waiting import wait_for

DRIP_S = 0.5  # the hostile server's pace: one byte every half second (what it does, not a wait of the test)
SERVER_BOUND_S = 60.0  # the hostile server gives up on its own after this (bounded even if a client never does)
DEADLINE_S = 2.0  # the agent's whole-answer allowance in these tests


@dataclass
class Hostile:
    """A loopback HTTP server answering the paths in ``mode`` as told ("drip" or "endless"), the rest from
    ``directory`` (when given); ``asked`` counts the requests per path."""

    mode: dict[str, str]
    directory: Path | None = None
    asked: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serve(self) -> http.server.ThreadingHTTPServer:
        hostile = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                with hostile.lock:
                    hostile.asked[path] = hostile.asked.get(path, 0) + 1
                how = hostile.mode.get(path)
                if how is None:
                    f = hostile.directory / path.lstrip("/").split("/", 1)[-1] if hostile.directory else None
                    body = f.read_bytes() if f is not None and f.is_file() else None
                    self.send_response(200 if body is not None else 404)
                    self.send_header("Content-Length", str(len(body or b"")))
                    self.end_headers()
                    self.wfile.write(body or b"")
                    return
                until = time.monotonic() + SERVER_BOUND_S
                if how == "drip-head":  # a status line, then header lines one byte at a time, never the blank line
                    try:
                        self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                        while time.monotonic() < until:
                            for b in b"X-Slow: 1\r\n":
                                self.wfile.write(bytes([b]))
                                self.wfile.flush()
                                time.sleep(DRIP_S)
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    self.close_connection = True
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()  # no length: the answer ends when the server closes, which it does not
                try:
                    while time.monotonic() < until:
                        if how == "drip":
                            self.wfile.write(b" ")
                            self.wfile.flush()
                            time.sleep(DRIP_S)
                        else:
                            self.wfile.write(b" " * 65536)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the agent hung up: what the bound looks like from here

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv


@pytest.fixture
def hostile() -> Iterator[tuple[Hostile, str]]:
    h = Hostile({})
    srv = h.serve()
    try:
        yield h, f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()
        srv.server_close()


def _infer_ok(url: str, images) -> bool:
    img = images[:4]
    body = {"inputs": [{"name": "input", "shape": list(img.shape), "datatype": "FP32",
                        "data": img.reshape(-1).tolist()}]}
    return httpx.post(f"{url}/v2/models/digits/infer", json=body, timeout=10).status_code == 200


@pytest.mark.parametrize(("how", "why"), [("drip", f"past the {DEADLINE_S:.0f}s deadline"),
                                          ("drip-head", f"its head in 2s, past the {DEADLINE_S:.0f}s deadline"),
                                          ("endless", "more than the 65536 bytes expected")])
def test_a_hostile_bootstrap_answer_ends_is_retried_and_the_model_keeps_serving(
        tmp_path, digits_bundle, test_images, hostile, caplog, how, why):
    """Before: the bootstrap was read with urllib's per-read timeout, which each dripped byte reset, so the agent's
    fleet link stayed in its first attempt for as long as the server liked (an hour's 1 MiB at 2 bytes a second)."""
    h, url = hostile
    h.mode["/api/v1/bootstrap"] = how
    caplog.set_level(logging.WARNING, logger="edgefleet.agent")
    # the speed check off: the whole-answer deadline alone must end a drip
    with installed_agent(tmp_path / "agent", digits_bundle, fleet_url=url, download_deadline_s=DEADLINE_S,
                         download_min_bytes_per_s=0, instances=1, intra_op_threads=1) as (_agent, agent_url):
        wait_for(lambda: h.asked.get("/api/v1/bootstrap", 0) >= 2, 30, "a second bootstrap attempt")
        assert _infer_ok(agent_url, test_images[0]), "the served model stopped answering"
        lines = [r.getMessage() for r in caplog.records if "/api/v1/bootstrap" in r.getMessage()]
        assert lines and all(why in m and "retrying in" in m for m in lines), lines
        # one line per ended attempt: the attempts the server saw, less the one under way
        assert len(lines) in (h.asked["/api/v1/bootstrap"] - 1, h.asked["/api/v1/bootstrap"]), lines


@pytest.fixture
def repo(tmp_path, digits_bundle) -> Repository:
    init_keys(tmp_path / "keys")
    r = Repository(tmp_path / "repo", KeyStore(tmp_path / "keys"))
    r.init()
    r.add_target("digits/1.0.0/x86-cpu.tar", digits_bundle, {"name": "digits", "version": "1.0.0",
                                                             "profile": "x86-cpu"})
    return r


@pytest.mark.parametrize(("how", "error"), [("drip", "SlowRetrievalError"), ("endless", "DownloadLengthMismatch")])
def test_hostile_tuf_metadata_is_a_fetch_error_to_retry(tmp_path, repo, digits_bundle, hostile, how, error):
    """python-tuf itself bounds a metadata file's bytes (16 KiB for the timestamp) and the gap between two reads,
    not an answer's total time: before, a dripped timestamp.json held the update for 2 hours (16 KiB at 2 bytes a
    second), and an endless one was a TrustError, never retried."""
    h, url = hostile
    h.directory = tmp_path / "repo"
    h.mode["/metadata/timestamp.json"] = how
    client = BundleFetcher(tmp_path / "client", f"{url}/metadata/", f"{url}/targets/", tmp_path / "keys" / "root.json",
                           min_bytes_per_s=0, deadline_s=DEADLINE_S)
    with pytest.raises(FetchError, match=error):
        client.fetch("digits/1.0.0/x86-cpu.tar", sha256_file(digits_bundle))
    assert h.asked.get("/metadata/timestamp.json") == 1


def test_an_endless_bundle_answer_is_retried_with_backoff_and_the_retry_installs(tmp_path, digits_bundle, caplog):
    """A real agent serving digits 1.0.0 is rolled out 1.1.0 by a real fleet; something in the path answers the
    first request for the bundle with more bytes than its signed length. Before, that was a TrustError: the
    install failed at once, never retried. Now the attempt ends at the signed length with one log line, is
    retried after a backoff draw, and the honest second answer installs; the old model answers meanwhile."""
    from tests.conftest import free_port, running_mosquitto
    from tests.fleet_harness import running_fleet
    from tests.test_tuf_attacks import Attacker, Reply
    from tests.test_tuf_bundles import rebundle

    device = "edge-retry"
    caplog.set_level(logging.WARNING, logger="edgefleet.agent")
    first: list[str] = []

    def once(path: str, body: bytes) -> Reply | None:
        if "/tuf/targets/" in path and not first:
            first.append(path)
            return Reply(body + b"\0" * 200_000)
        return None

    attacker = Attacker(free_port(), rule=once)
    srv = attacker.serve()
    try:
        with running_mosquitto(tmp_path) as broker, \
                running_fleet(tmp_path, broker.url, public_url=attacker.url, rollout_tick_s=0.05) as (fs, url):
            attacker.upstream = url
            fs.service.register_device(device)
            fs.service.upload_bundle(rebundle(digits_bundle, tmp_path / "v110.tar", version="1.1.0"))
            with installed_agent(tmp_path / "agent", digits_bundle, device_id=device, fleet_url=attacker.url,
                                 trusted_root=tmp_path / "keys" / "root.json", install_retries=2,
                                 max_batch_size=8, instances=1, intra_op_threads=1) as (_a, agent_url):
                wait_for(lambda: fs.service.get_device(device)["online"], 30, "agent online")
                fs.service.create_rollout("digits", "1.1.0", [device])
                seen: list[str | None] = []

                def upgraded() -> bool:
                    seen.append(served_version(agent_url))
                    return seen[-1] == "1.1.0"

                wait_for(upgraded, 90, "1.1.0 installed on the retry")
        assert set(seen) <= {"1.0.0", "1.1.0"}, f"the agent stopped serving meanwhile: {seen}"
        lines = [r.getMessage() for r in caplog.records if "fetch attempt" in r.getMessage()]
        assert len(lines) == 1 and "DownloadLengthMismatchError" in lines[0] and "retrying in" in lines[0], lines
        assert first, "the endless answer was never sent"
    finally:
        srv.shutdown()
        srv.server_close()
