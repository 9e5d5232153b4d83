"""The Pythons the boxes ship: the agent (and what it imports from protocol/ and engines/) runs on 3.10
(JetPack 6, Ubuntu 22.04), 3.11.2 (Raspberry Pi OS Bookworm, Debian 12) and newer.

``make test-py310`` runs the agent's and the protocol's tests on 3.10 (with this file); ``make test-arm64``
runs the agent on Debian's 3.11.2; ``make lint`` checks the source with vermin against 3.10.
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from edgefleet.agent._compat import run_with_loop
from tests.conftest import REPO


@pytest.mark.parametrize(("version", "box"), [
    ("3.10.12", "JetPack 6 / Ubuntu 22.04"),
    ("3.11.2", "Raspberry Pi OS Bookworm / Debian 12"),
    ("3.12.3", "Ubuntu 24.04"),
    ("3.13.5", "Debian 13"),
])
def test_requires_python_admits_the_python_of(version, box):
    spec = SpecifierSet(md.metadata("edgefleet")["Requires-Python"])
    assert version in spec, f"{box} ships Python {version}; Requires-Python is {spec}"


def test_requires_python_refuses_what_the_agent_does_not_run_on():
    spec = SpecifierSet(md.metadata("edgefleet")["Requires-Python"])
    assert "3.9.18" not in spec and "3.8.10" not in spec  # JetPack 5 (3.8): not supported


def test_the_daemon_s_loop_runner_on_this_python():
    """agent._compat.run_with_loop: asyncio.Runner on 3.11+, its steps by hand on 3.10: the given loop runs the
    coroutine, and afterwards what was left is cancelled, async generators are finished, the loop is closed."""
    made: list[asyncio.AbstractEventLoop] = []
    seen: dict[str, object] = {}

    def factory() -> asyncio.AbstractEventLoop:
        made.append(asyncio.new_event_loop())
        return made[-1]

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise

    async def agen():
        try:
            yield 1
            yield 2
        finally:
            seen["agen_closed"] = True

    async def main() -> str:
        seen["loop"] = asyncio.get_running_loop()
        asyncio.get_running_loop().create_task(forever())
        g = agen()
        assert await g.__anext__() == 1  # left suspended: shutdown_asyncgens finishes it
        seen["g"] = g
        await asyncio.sleep(0)
        try:
            await asyncio.wait_for(asyncio.sleep(10), 0.01)
        except asyncio.TimeoutError:  # on 3.10 not the builtin TimeoutError: what the agent's code catches
            seen["timeout"] = True
        return "done"

    assert run_with_loop(main(), factory) == "done"
    assert len(made) == 1 and seen["loop"] is made[0] and made[0].is_closed()
    assert seen.get("cancelled") and seen.get("agen_closed") and seen.get("timeout")
    assert run_with_loop(asyncio.sleep(0, "plain")) == "plain"  # no factory: asyncio's own loop


def test_the_agent_side_of_the_source_uses_nothing_newer_than_python_3_10():
    """vermin (a dev dependency; `make lint` runs it too) on agent/, engines/, judge/, protocol/ and compiler/."""
    vermin = Path(sys.executable).parent / "vermin"
    if not vermin.exists():
        pytest.skip("vermin is not installed in this environment (the dev extra has it; make lint runs it)")
    dirs = [str(REPO / d) for d in ("agent", "engines", "judge", "protocol", "compiler") if (REPO / d).is_dir()]
    r = subprocess.run([str(vermin), "--no-tips", "--violations", "--eval-annotations",
                        "--backport", "typing_extensions", "-t=3.10-", *dirs],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
