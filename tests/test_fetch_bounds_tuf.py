"""The agent's TUF downloads bounded in total time and bytes (agent/link/fetch.py): python-tuf with the agent's fetcher
against a hostile loopback server (tests/test_agent_fetch_bounds.Hostile) over a repository the fleet's code signed,
and a real agent rolled out a bundle by a real fleet through a proxy that answers with endless data once.
(Apart from tests/test_agent_fetch_bounds.py: the fleet's code runs on Python 3.11+, the agent's tests on 3.10.)
"""

from __future__ import annotations

import logging

import pytest

from edgefleet.agent.errors import FetchError
from edgefleet.agent.link.updater import BundleFetcher
from edgefleet.fleet.keys import KeyStore, init_keys
from edgefleet.fleet.tuf_repo import Repository
from edgefleet.protocol.bundle import sha256_file
from tests.agent_harness import installed_agent, served_version
from tests.test_agent_fetch_bounds import DEADLINE_S, hostile
from tests.waiting import wait_for

__all__ = ["hostile"]  # the fixture, used here


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
            fs.service.devices.register_device(device)
            fs.service.models.upload_bundle(rebundle(digits_bundle, tmp_path / "v110.tar", version="1.1.0"))
            with installed_agent(tmp_path / "agent", digits_bundle, device_id=device, fleet_url=attacker.url,
                                 trusted_root=tmp_path / "keys" / "root.json", install_retries=2,
                                 max_batch_size=8, instances=1, intra_op_threads=1) as (_a, agent_url):
                wait_for(lambda: fs.service.devices.get_device(device).online, 30, "agent online")
                fs.service.rollouts.create_rollout("digits", "1.1.0", [device])
                seen: list[str | None] = []

                def upgraded() -> bool:
                    seen.append(served_version(agent_url))
                    return seen[-1] == "1.1.0"

                wait_for(upgraded, 90, "1.1.0 installed on the retry")
        assert set(seen) <= {"1.0.0", "1.1.0"}, f"the agent stopped serving meanwhile: {seen}"
        lines = [r.getMessage() for r in caplog.records if "fetch attempt" in r.getMessage()]
        # since resumable downloads (issue 43), the answer is cut at its signed length and the rest is fetched by
        # range on the retry, which need not be a failed fetch attempt: at most one such line, and it names the bound
        assert len(lines) <= 1 and all("DownloadLengthMismatchError" in x and "retrying in" in x for x in lines), lines
        assert first, "the endless answer was never sent"
    finally:
        srv.shutdown()
        srv.server_close()
