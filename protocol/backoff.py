"""Full-jitter exponential backoff: the wait before every reconnect and retry in edgefleet.

The wait before retry ``attempt`` (0 for the first retry) is drawn uniformly from
``[0, min(cap_s, base_s * 2**attempt)]`` ("full jitter", as in AWS's "Exponential Backoff And
Jitter"). Without the draw, every device that lost the broker at the same moment (a broker restart,
a site's uplink coming back) would retry at the same moments, 1 s, 2 s, 4 s later, each time in one
burst; with it, their attempts spread evenly over each window, so at most a share of about
``2 * width / base_s`` of the devices (``width`` seconds of time) comes back in any slice of the first
windows, and ``width / cap_s`` per attempt once the window is capped.

The draw uses the operating system's randomness (``random.SystemRandom``): boxes booted from one
image, or a process that seeds the ``random`` module, still draw apart.

``paho_next_delay`` gives paho-mqtt's own reconnect loop the same waits: paho's
``reconnect_delay_set`` only doubles a fixed delay, so the link calls it before every wait with a new
draw (min = max = the draw: paho waits exactly that long once).
"""

from __future__ import annotations

import math
import random
import threading
from typing import Any

__all__ = ["MQTT_RECONNECT_BASE_S", "MQTT_RECONNECT_CAP_S", "Backoff", "full_jitter", "paho_next_delay", "window_s"]

_RNG = random.SystemRandom()
# a device's MQTT reconnect windows (the agent's link, and the simulator that stands in for it): 1, 2, 4, 8, 15 s
MQTT_RECONNECT_BASE_S, MQTT_RECONNECT_CAP_S = 1.0, 15.0
MAX_WINDOW_S = 86_400.0  # a cap above a day is a configuration mistake, not a backoff


def window_s(attempt: int, base_s: float, cap_s: float) -> float:
    """The upper end of retry ``attempt``'s window: ``min(cap_s, base_s * 2**attempt)`` seconds."""
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ValueError(f"attempt must be an integer >= 0, not {attempt!r}")
    if not (math.isfinite(base_s) and base_s > 0):
        raise ValueError(f"base_s must be a finite number > 0, not {base_s!r}")
    if not (math.isfinite(cap_s) and base_s <= cap_s <= MAX_WINDOW_S):
        raise ValueError(f"cap_s must be between base_s ({base_s}) and {MAX_WINDOW_S:.0f}, not {cap_s!r}")
    # 2**attempt is bounded before it is computed: after 64 doublings any base is past any cap
    return min(cap_s, base_s * 2.0 ** min(attempt, 64))


def full_jitter(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """The wait before retry ``attempt`` (0 = the first): uniform in ``[0, window_s(attempt, base_s, cap_s)]``."""
    return (rng or _RNG).uniform(0.0, window_s(attempt, base_s, cap_s))


class Backoff:
    """The attempts of one retry loop: ``next_s()`` draws the next wait and counts the attempt;
    ``reset()`` after a success starts again from the first window. Thread-safe (paho calls from its
    network thread while another thread may reset)."""

    def __init__(self, base_s: float, cap_s: float, rng: random.Random | None = None):
        window_s(0, base_s, cap_s)  # checks the bounds once, here
        self.base_s, self.cap_s = base_s, cap_s
        self.attempt = 0
        self._rng = rng
        self._lock = threading.Lock()

    def next_s(self) -> float:
        with self._lock:
            attempt = self.attempt
            self.attempt = min(attempt + 1, 64)
        return full_jitter(attempt, self.base_s, self.cap_s, self._rng)

    def reset(self) -> None:
        with self._lock:
            self.attempt = 0


def paho_next_delay(client: Any, backoff: Backoff) -> float:
    """Make paho-mqtt's next reconnect wait a fresh full-jitter draw; call it from ``on_disconnect`` and
    ``on_connect_fail`` (paho calls them on its network thread just before it waits). ``reconnect_delay_set``
    also clears paho's doubling, so the next wait is exactly the draw."""
    delay = backoff.next_s()
    client.reconnect_delay_set(min_delay=delay, max_delay=delay)
    return delay
