"""Agent config, telemetry spool and metrics."""

import json

import pytest

from edgefleet.agent.config import load_config
from edgefleet.agent.core.metrics import Metrics
from edgefleet.agent.link.spool import Spool
from edgefleet.protocol.errors import ConfigError


def test_config_file_with_flag_overrides(tmp_path):
    p = tmp_path / "agent.yaml"
    p.write_text("device_id: cam-7\nfleet_url: http://127.0.0.1:8700/\ndata_dir: /tmp/x\nmax_batch_size: 8\n")
    cfg = load_config(p, {"max_batch_size": 4, "http_port": None})
    assert cfg.device_id == "cam-7" and cfg.max_batch_size == 4 and cfg.fleet_url == "http://127.0.0.1:8700"


def test_unknown_config_key_names_file_and_key(tmp_path):
    p = tmp_path / "agent.yaml"
    p.write_text("device_id: cam-7\nfleet_url: http://x\ndata_dir: /tmp/x\nmax_batch: 8\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, {})
    assert str(p) in str(e.value) and "unknown key 'max_batch'" in str(e.value)


@pytest.mark.parametrize(("text", "msg"), [
    ("device_id: 'a/b'\nfleet_url: http://x\ndata_dir: /t\n", "device_id"),
    ("device_id: a\nfleet_url: ftp://x\ndata_dir: /t\n", "must start with http"),
    ("device_id: a\nfleet_url: http://x\n", "missing setting 'data_dir' (flag --data-dir"),
    ("device_id: a\nfleet_url: http://x\ndata_dir: /t\nmax_batch_size: 0\n", "max_batch_size"),
    ("- a list\n", "expected a mapping"),
    ("device_id: [unclosed\n", "not valid YAML"),
])
def test_bad_config_values(tmp_path, text, msg):
    p = tmp_path / "agent.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
        load_config(p, {})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml", {})


def test_spool_sequence_survives_restart_and_acks(tmp_path):
    s = Spool(tmp_path)
    seqs = [s.append(lambda n: json.dumps({"seq": n}).encode()) for _ in range(3)]
    assert seqs == [0, 1, 2]
    s.ack_seq(0)
    s.ack_seq(1)
    s.ack_seq(2)
    again = Spool(tmp_path)  # restart with an empty spool: numbering continues, never reused
    assert again.append(lambda n: b"{}") == 3


def test_spool_keeps_unacked_records_across_restart(tmp_path):
    s = Spool(tmp_path)
    for _ in range(4):
        s.append(lambda n: json.dumps({"seq": n}).encode())
    s.ack_seq(1)
    again = Spool(tmp_path)
    assert [int(p.stem) for p in again.pending()] == [0, 2, 3]
    assert json.loads(again.pending()[0].read_bytes()) == {"seq": 0}


def test_spool_is_bounded(tmp_path):
    s = Spool(tmp_path, max_records=10)
    for _ in range(15):
        s.append(lambda n: b"{}")
    assert len(s.pending()) == 10 and s.dropped == 5
    assert int(s.pending()[0].stem) == 5  # the oldest went first


def test_metrics_percentiles_and_reset():
    m = Metrics()
    for i in range(100):
        m.request_done((i + 1) / 1000, ok=i % 10 != 0)
    m.batch_done(4)
    m.batch_done(8)
    snap = m.snapshot_and_reset()
    assert snap.requests == 100 and snap.errors == 10
    assert 49 <= snap.latency_p50_ms <= 51 and snap.latency_max_ms == 100
    assert snap.batch_size_mean == 6 and snap.batch_size_max == 8
    empty = m.snapshot_and_reset()
    assert empty.requests == 0 and empty.latency_p50_ms is None
    assert m.total_requests == 100


def test_rejected_records_are_set_aside_not_resent(tmp_path):
    s = Spool(tmp_path)
    for _ in range(3):
        s.append(lambda n: json.dumps({"seq": n}).encode())
    assert s.set_aside(1) is True
    assert s.set_aside(1) is False
    assert [int(p.stem) for p in s.pending()] == [0, 2]
    assert json.loads((s.rejected_dir / f"{1:012d}.json").read_bytes()) == {"seq": 1}
    assert [int(p.stem) for p in Spool(tmp_path).pending()] == [0, 2]  # still so after a restart


def test_successes_counted_in_bulk_read_the_same_as_one_by_one():
    """ModelMetrics counts successful requests in bulk (fold): whatever reads the counters -- the exposition, the
    Triton statistics, telemetry, /metrics/summary -- sees every request at once, exactly as counted one by one."""
    import random

    from prometheus_client import CollectorRegistry, Histogram

    from edgefleet.agent.core.metrics import FOLD_EVERY, LATENCY_BUCKETS, _observe_many

    rng = random.Random(7)
    values = [rng.choice(LATENCY_BUCKETS) for _ in range(50)] + [rng.uniform(0, 12) for _ in range(500)]
    one, bulk = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("h", "h", ["m"], buckets=LATENCY_BUCKETS, registry=one).labels("x")
    h2 = Histogram("h", "h", ["m"], buckets=LATENCY_BUCKETS, registry=bulk).labels("x")
    for v in values:
        h1.observe(v)
    _observe_many(h2, values[:3])  # below the bulk threshold: one by one
    _observe_many(h2, values[3:])

    def samples(reg):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in reg.collect() for s in f.samples
                if not s.name.endswith("_created")}

    got, want = samples(bulk), samples(one)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k

    m = Metrics()
    mm = m.for_model("digits", "1")
    for i in range(FOLD_EVERY + 5):  # one fold on the way, five still waiting
        mm.request(0.001 * (i % 7 + 1), 200)
    mm.request(0.5, 503)
    assert m.total_requests == FOLD_EVERY + 6 and m.total_errors == 1
    st = mm.stats()["inference_stats"]
    assert st["success"]["count"] == FOLD_EVERY + 5 and st["fail"]["count"] == 1
    text = m.exposition().decode()
    assert f'edgefleet_inference_requests_total{{model="digits",version="1"}} {FOLD_EVERY + 6}.0' in text
    assert f'edgefleet_request_duration_seconds_count{{model="digits",version="1"}} {FOLD_EVERY + 6}.0' in text
    mm.request(0.002, 200)
    snap = m.snapshot_and_reset()
    assert snap.requests == FOLD_EVERY + 7 and snap.errors == 1
