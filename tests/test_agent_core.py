"""The agent's core apart from its transports (issue 31.2): the host that owns the models and batches
(agent/core/host.py) imports no web framework, no transport imports another's framework, and the other parts change
the host only through its verbs."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgefleet.agent.core.batching.settings import BatchSettings
from edgefleet.agent.core.host import IndexEntry, ModelHost
from edgefleet.agent.core.metrics import Metrics

AGENT = Path(__file__).resolve().parents[1] / "agent"
WEB = ("starlette", "uvicorn", "grpc", "fastapi", "anyio", "h11", "httptools")


TRANSPORTS = ("edgefleet.agent.transports.http", "edgefleet.agent.transports.grpc", "edgefleet.agent.transports.local")


def _imported_after(module: str) -> list[str]:
    """The web frameworks and agent transports in sys.modules after importing ``module`` alone, in a fresh
    interpreter."""
    code = (f"import sys, json, {module}\n"
            f"web = {{m.split('.')[0] for m in sys.modules}} & set({list(WEB)!r})\n"
            f"print(json.dumps(sorted(web | (set(sys.modules) & set({list(TRANSPORTS)!r}) - {{{module!r}}}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", [
    "edgefleet.agent.core.host",  # the core
    "edgefleet.agent.install.job",  # the installer asks the core, never a transport
    "edgefleet.agent.transports.local",  # the local socket: asyncio alone
    "edgefleet.agent.transports.grpc",  # grpcio only once it starts (lazily)
])
def test_the_core_and_each_transport_import_no_framework_and_no_other_transport(module):
    assert _imported_after(module) == []


def _host_assignments(path: Path) -> list[str]:
    """``<...>host.<attr> = ...`` (or ``+=``, or a tuple target naming one) anywhere in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        flat: list[ast.expr] = []
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets.extend(t.elts)
            else:
                flat.append(t)
        for t in flat:
            if isinstance(t, ast.Attribute):
                owner = t.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
                if name == "host":
                    found.append(f"{path.name}:{t.lineno} host.{t.attr} =")
    return found


def test_no_part_of_the_agent_sets_the_hosts_attributes():
    """The installer, the daemon and the transports ask the host by verbs (swap, remove, start_shadow, end_shadow,
    set_index); only agent/core/host.py itself assigns its attributes."""
    found = [hit for p in sorted(AGENT.glob("*.py")) if p.name != "host.py" for hit in _host_assignments(p)]
    assert found == []


def test_the_host_state_others_read_is_read_only():
    host = ModelHost(BatchSettings(), Metrics())
    for attr in ("current", "shadow"):
        with pytest.raises(AttributeError):
            setattr(host, attr, None)


class _Mirror:
    def __init__(self, name: str):
        self.manifest = type("M", (), {"name": name, "version": "1.0.0"})()
        self.closed = False

    def offer(self, *a):
        pass

    def close(self):
        self.closed = True


def test_one_shadow_at_a_time_and_end_shadow_hands_it_back():
    host = ModelHost(BatchSettings(), Metrics())
    first = _Mirror("digits")
    host.start_shadow(first)  # type: ignore[arg-type]
    assert host.shadow is first
    with pytest.raises(RuntimeError, match=r"already shadowing digits 1\.0\.0"):
        host.start_shadow(_Mirror("other"))  # type: ignore[arg-type]
    assert host.shadow is first and not first.closed
    assert host.end_shadow() is first and host.shadow is None and host.end_shadow() is None


def test_the_index_source_is_given_by_a_verb():
    host = ModelHost(BatchSettings(), Metrics())
    assert host.repository_index() == []
    host.set_index(lambda: [IndexEntry("digits", "1.0.0", "UNAVAILABLE", "installed; not loaded")])
    assert host.repository_index() == [{"name": "digits", "version": "1.0.0", "state": "UNAVAILABLE",
                                        "reason": "installed; not loaded"}]
    assert host.repository_index(ready_only=True) == []
