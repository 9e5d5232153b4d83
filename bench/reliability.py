"""The README's reliability table, from the tests that try to break edgefleet.

    .venv/bin/python bench/reliability.py            # about 6 minutes on 2 cores
    .venv/bin/python bench/reliability.py --json

Runs the attack, crash, outage, fuzz and MQTT-ACL tests once (pytest, in a child process) with
EDGEFLEET_RELIABILITY_OUT set; each test appends what it tried and what happened, and this script
sums them up:

- attacks tried / refused (TUF attacks at a real agent over HTTP, compromised-server and revoked-key tests)
- SIGKILL iterations / boxes left without a working model (goal 0)
- broker outage: telemetry records sent / delivered (goal equal)
- fuzz cases run / server errors (goal 0): schemathesis on both OpenAPI documents, malformed MQTT payloads
- MQTT ACL probes tried / refused (a real Mosquitto)
- trust-boundary probes tried / refused: an operator acting as the fleet or locking a device out, another
  origin posting console forms, nested bodies, crafted bundle archives, oversized images, a device taking
  another's MQTT session or reading its retained messages (tests/test_trust_boundaries.py, and every test
  marked ``@pytest.mark.trust``: tests/conftest.py records whether it passed, i.e. the attack was refused)
- malformed MQTT messages from an enrolled device: sent, and whether the fleet still stored a healthy
  device's report afterwards

A test that fails still reports what it saw; the exit code is pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_tuf_attacks.py", "tests/test_keys.py", "tests/test_crash_random.py", "tests/test_outage.py",
         "tests/test_fuzz.py", "tests/test_mqtt_acl.py", "tests/test_trust_boundaries.py"]
# further tests that record "trust" probes, where present
TESTS += [t for t in ("tests/test_broker_identity.py", "tests/test_bundle_upload_checks.py",
                      "tests/test_agent_image_memory.py", "tests/test_trust_http_conn.py") if (REPO / t).exists()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.jsonl"
        env = {**os.environ, "EDGEFLEET_RELIABILITY_OUT": str(out)}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=REPO,
                           env=env, stdout=sys.stderr)
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    by: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by[row["test"]].append(row)
    attacks = by["attack"]
    crash = by["crash"]
    outage = by["outage"]
    fuzz = by["fuzz"]
    acl = by["acl"]
    trust = by["trust"]
    malformed = by["malformed_mqtt"]
    figures = {
        "attacks": {"tried": len(attacks), "refused": sum(bool(x["refused"]) for x in attacks),
                    "names": [x["attack"] for x in attacks]},
        "sigkill": {"iterations": sum(x["iterations"] for x in crash), "kills": sum(x["kills"] for x in crash),
                    "without_model": sum(x["without_model"] for x in crash)},
        "outage": {"sent": sum(x["sent"] for x in outage), "delivered": sum(x["delivered"] for x in outage)},
        "fuzz": {"cases": sum(x.get("cases", 0) for x in fuzz), "server_errors": sum(x["server_errors"] for x in fuzz),
                 "targets": {x["target"]: x.get("cases", 0) for x in fuzz}},
        "acl": {"tried": sum(x["tried"] for x in acl), "refused": sum(x["refused"] for x in acl)},
        "trust": {"tried": len(trust), "refused": sum(bool(x["refused"]) for x in trust),
                  "not_refused": [x["probe"] for x in trust if not x["refused"]]},
        "malformed_mqtt": {"sent": sum(x["sent"] for x in malformed),
                           "still_storing": bool(malformed) and all(x["still_storing"] for x in malformed)},
        "pytest_exit": r.returncode,
    }
    if a.json:
        print(json.dumps(figures, indent=2))
        return r.returncode
    f = figures
    print("| what | tried | held |")
    print("| --- | --- | --- |")
    print(f"| attacks on updates (TUF, keys) | {f['attacks']['tried']} | {f['attacks']['refused']} refused |")
    print(f"| SIGKILL during download/install/swap | {f['sigkill']['iterations']} iterations "
          f"({f['sigkill']['kills']} kills) | {f['sigkill']['without_model']} boxes without a working model |")
    print(f"| broker outage, telemetry records | {f['outage']['sent']} sent | {f['outage']['delivered']} delivered |")
    targets = ", ".join(f"{k} {v}" for k, v in f["fuzz"]["targets"].items())
    print(f"| fuzz cases ({targets}) | {f['fuzz']['cases']} | {f['fuzz']['server_errors']} server errors |")
    print(f"| MQTT ACL probes (Mosquitto) | {f['acl']['tried']} | {f['acl']['refused']} refused |")
    print(f"| trust-boundary probes (operator, other origin, archives, images, MQTT sessions) | "
          f"{f['trust']['tried']} | {f['trust']['refused']} refused |")
    storing = "yes" if f["malformed_mqtt"]["still_storing"] else "NO"
    print(f"| malformed MQTT messages from an enrolled device | {f['malformed_mqtt']['sent']} sent | "
          f"fleet still storing: {storing} |")
    return r.returncode


if __name__ == "__main__":
    raise SystemExit(main())
