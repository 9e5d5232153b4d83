"""A real bad link between an agent and its fleet (issue 43): a network namespace joined to this one by a veth pair,
``tc netem`` (rate, delay, loss) on both ends, and ``ip link set down/up`` to cut it; on a kernel without netem, tbf
for the rate, the relay for the delay and nftables for the loss. Needs root, iproute2 and nftables
(.ci/ensure-system-deps); ``namespaces_allowed()`` says whether this machine lets us (containers often do not).

The agent and the fleet stay in this namespace. The agent talks to ``far`` (the namespace's end of the veth), where a
relay (tests/cutting_proxy.py run with ``ip netns exec``) forwards to ``near`` (this namespace's end), where a
CuttingProxy forwards to the fleet on 127.0.0.1 and counts the bytes it carried. So every byte of the fleet's
answers crosses the veth twice: near -> far (netem on the near end: rate, delay, loss) and far -> agent (netem on
the far end: rate, delay).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cutting_proxy import CuttingProxy

__all__ = ["BadLink", "agent_behind_bad_link", "bad_link", "namespaces_allowed"]

ROOT = Path(__file__).resolve().parents[1]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def namespaces_allowed() -> str | None:
    """None if network namespaces and netem work here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    name = f"efprobe{os.getpid()}"
    try:
        r = _ip("netns", "add", name, check=False)
        if r.returncode:
            return f"ip netns add: {r.stderr.strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ip: {exc}"
    finally:
        _ip("netns", "del", name, check=False)


def _nft_loss(ns: str, far: str, loss_pct: float) -> str:
    """Without netem, packet loss from nftables in the namespace: ``loss_pct`` of the packets that arrive on ``far``
    (the fleet's answers, towards the agent) dropped at random (``numgen random``), so TCP retransmits as on a lossy
    link. -> what was set, or why there is no loss (no ``nft``: Debian's nftables; a kernel without nf_tables)."""
    if loss_pct <= 0:
        return "no packet loss"
    per_mille = round(loss_pct * 10)
    rules = (f"table inet efloss {{\n chain input {{\n  type filter hook input priority 0; policy accept;\n"
             f"  iifname \"{far}\" numgen random mod 1000 < {per_mille} counter drop\n }}\n}}\n")
    try:
        r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"no packet loss (nft: {exc})"
    if r.returncode:
        return f"no packet loss (nft: {r.stderr.strip()[:200]})"
    return f"{per_mille / 10:g}% of the packets towards the agent dropped by nftables"


@dataclass
class BadLink:
    url: str  # http://far:port: the fleet through the bad link
    proxy: CuttingProxy  # this side's relay: bytes carried, cuts
    near_if: str
    emulation: str  # what the link really is (netem, or what stands in for it)
    ns: str = ""  # the namespace of the link's far end

    def dropped(self) -> int | None:
        """Packets the emulated loss dropped so far (nftables' counter); None where netem or nothing drops them."""
        r = subprocess.run(["ip", "netns", "exec", self.ns, "nft", "list", "table", "inet", "efloss"],
                           capture_output=True, text=True, timeout=30, check=False)
        m = re.search(r"counter packets (\d+)", r.stdout) if r.returncode == 0 else None
        return int(m.group(1)) if m else None

    def cut(self, down_s: float) -> None:
        """The link down for ``down_s`` seconds, then up again."""
        _ip("link", "set", self.near_if, "down")
        time.sleep(down_s)
        _ip("link", "set", self.near_if, "up")


@contextlib.contextmanager
def bad_link(fleet_port: int, rate: str = "1mbit", delay_ms: int = 150, loss_pct: float = 5.0,
             cut_every: int = 0) -> Iterator[BadLink]:
    """The fleet on 127.0.0.1:``fleet_port`` behind a bad link: ``rate`` each way, ``delay_ms`` each way (the round
    trip is twice that), ``loss_pct`` of the packets towards the agent lost; ``cut_every``: the relay also cuts each
    connection after that many bytes (0: never)."""
    pid = os.getpid()
    ns, near, far = f"ef{pid}", f"efn{pid}", f"eff{pid}"
    net = f"10.213.{pid % 250}"
    near_ip, far_ip = f"{net}.1", f"{net}.2"
    relay: subprocess.Popen[str] | None = None
    proxy: CuttingProxy | None = None
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", near, "type", "veth", "peer", "name", far)
        _ip("link", "set", far, "netns", ns)
        _ip("addr", "add", f"{near_ip}/30", "dev", near)
        _ip("link", "set", near, "up")
        _ip("-n", ns, "addr", "add", f"{far_ip}/30", "dev", far)
        _ip("-n", ns, "link", "set", far, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        tc, in_ns = ["tc", "qdisc", "add", "dev"], ["ip", "netns", "exec", ns]
        netem = subprocess.run([*tc, near, "root", "netem", "rate", rate, "delay", f"{delay_ms}ms",
                                "loss", f"{loss_pct}%", "limit", "10000"], capture_output=True, timeout=30)
        relay_delay_s = 0.0
        if netem.returncode == 0:
            subprocess.run([*in_ns, *tc, far, "root", "netem", "rate", rate, "delay", f"{delay_ms}ms", "limit",
                            "10000"], check=True, timeout=30)
            emulation = f"netem: {rate} each way, {delay_ms} ms each way, {loss_pct}% loss towards the agent"
        else:  # a kernel without sch_netem (a Firecracker VM's): tbf for the rate, the relay's queue for the delay
            for cmd in ([*tc, near], [*in_ns, *tc, far]):
                subprocess.run([*cmd, "root", "tbf", "rate", rate, "burst", "32kb", "latency", "400ms"], check=True,
                               timeout=30)
            relay_delay_s = 2 * delay_ms / 1000
            emulation = (f"no netem in this kernel: tbf {rate} each way, {2 * delay_ms} ms added by the relay, "
                         f"{_nft_loss(ns, far, loss_pct)}")
        proxy = CuttingProxy(fleet_port, host=near_ip, cut_every=cut_every)
        near_port = proxy.start()
        relay = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(ROOT / "tests" / "cutting_proxy.py"),
                                  far_ip, "8080", near_ip, str(near_port), str(relay_delay_s)],
                                 stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert relay.stdout is not None and relay.stdout.readline().strip() == "relaying", "the relay did not start"
        yield BadLink(f"http://{far_ip}:8080", proxy, near, emulation, ns)
    finally:
        if relay is not None:
            relay.kill()
            relay.wait(10)
        if proxy is not None:
            proxy.stop()
        _ip("link", "del", near, check=False)
        _ip("netns", "del", ns, check=False)


@contextlib.contextmanager
def agent_behind_bad_link(tmp: Path, installed: Path, new: Path, device: str, install_retries: int,
                          online_s: float, **link: Any) -> Iterator[tuple[Any, str, BadLink, str]]:
    """A real Mosquitto, a real fleet holding ``new`` and a real agent serving ``installed``, the agent's HTTP to the
    fleet through ``bad_link(**link)``: (fleet server, fleet URL, the link, the agent's inference URL), the agent
    online."""
    from tests.agent_harness import installed_agent
    from tests.conftest import running_mosquitto
    from tests.fleet_harness import running_fleet
    from tests.waiting import wait_for

    with running_mosquitto(tmp) as broker, bad_link(0, **link) as bad, \
            running_fleet(tmp, broker.url, rollout_tick_s=0.05, public_url=bad.url) as (fs, url):
        bad.proxy.upstream_port = int(url.rsplit(":", 1)[1])  # the fleet's answers name URLs through the link
        fs.service.devices.register_device(device)
        fs.service.models.upload_bundle(new)
        with installed_agent(tmp / "agent", installed, device_id=device, fleet_url=bad.url,
                             trusted_root=tmp / "keys" / "root.json", install_retries=install_retries,
                             max_batch_size=8, instances=1, intra_op_threads=1) as (_a, agent_url):
            wait_for(lambda: fs.service.devices.get_device(device).online, online_s, "agent online")
            yield fs, url, bad, agent_url
