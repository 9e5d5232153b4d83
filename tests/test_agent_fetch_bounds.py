"""Every answer the agent takes from its fleet is bounded in total time and bytes (agent/link/fetch.py), through a real
HTTP server on loopback that answers the way a hostile fleet, or anything in the path, could (here at the agent's
bootstrap; python-tuf's downloads in tests/test_fetch_bounds_tuf.py, which needs the fleet's code):

- a drip-fed answer (one byte every half second, for ever, in the body or in the head): it ends at its
  whole-answer deadline, not after a per-read timeout that each byte resets;
- an endless answer: it ends at its bound in bytes.

Against the real agent (its bootstrap loop): the attempt ends with one log line, a retry is scheduled with
backoff, and the model the agent serves keeps answering meanwhile.
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

from edgefleet.protocol import lograte
from tests.agent_harness import installed_agent
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
    # the same kind of line from earlier tests in this process must not use up its rate limit here (CI, py310: the
    # first attempt's line dropped, none seen when the second attempt began)
    flt = lograte.installed()
    if flt is not None:
        flt.reset()
    # the speed check off: the whole-answer deadline alone must end a drip
    with installed_agent(tmp_path / "agent", digits_bundle, fleet_url=url, download_deadline_s=DEADLINE_S,
                         download_min_bytes_per_s=0, instances=1, intra_op_threads=1) as (_agent, agent_url):
        wait_for(lambda: h.asked.get("/api/v1/bootstrap", 0) >= 2, 30, "a second bootstrap attempt")
        assert _infer_ok(agent_url, test_images[0]), "the served model stopped answering"
        # this agent's lines: a count of an earlier test's dropped records (protocol/lograte) may be told here too
        lines = [r.getMessage() for r in caplog.records if f"{url}/api/v1/bootstrap" in r.getMessage()]
        assert lines and all(why in m and "retrying in" in m for m in lines), lines
        # one line per ended attempt: the attempts the server saw, less the one under way
        assert len(lines) in (h.asked["/api/v1/bootstrap"] - 1, h.asked["/api/v1/bootstrap"]), lines
