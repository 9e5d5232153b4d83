"""protocol.backoff: full jitter, uniform in [0, min(cap, base * 2**attempt)], and bounded in what it accepts."""

from __future__ import annotations

import math
import random

import pytest

from edgefleet.protocol.backoff import Backoff, full_jitter, paho_next_delay, window_s


def test_the_window_doubles_from_the_base_up_to_the_cap():
    assert [window_s(a, 1.0, 15.0) for a in range(7)] == [1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0]
    assert [window_s(a, 0.2, 2.0) for a in range(5)] == [0.2, 0.4, 0.8, 1.6, 2.0]
    # an attempt count from a loop that ran for years neither overflows nor leaves the cap
    assert window_s(10**9, 1.0, 30.0) == 30.0


@pytest.mark.parametrize("attempt", [0, 1, 3, 6])
def test_draws_fill_the_window_uniformly(attempt):
    """10,000 draws stay inside [0, window] and each tenth of the window holds its tenth of them (a seeded
    generator: the check is exact for this stream; the bounds below are 5 standard deviations wide)."""
    rng = random.Random(attempt)
    window = window_s(attempt, 1.0, 15.0)
    draws = [full_jitter(attempt, 1.0, 15.0, rng) for _ in range(10_000)]
    assert min(draws) >= 0.0 and max(draws) <= window
    deciles = [0] * 10
    for d in draws:
        deciles[min(int(d / window * 10), 9)] += 1
    assert all(850 <= n <= 1150 for n in deciles), deciles
    assert abs(sum(draws) / len(draws) - window / 2) < 0.02 * window
    # the low end is reached: full jitter, not "half the window plus jitter"
    assert min(draws) < 0.01 * window


def test_the_default_generator_is_the_systems_and_ignores_a_seeded_random_module():
    random.seed(1)
    a = [full_jitter(2, 1.0, 15.0) for _ in range(200)]
    random.seed(1)
    b = [full_jitter(2, 1.0, 15.0) for _ in range(200)]
    assert a != b  # two boxes that seeded `random` alike still draw apart
    assert all(0.0 <= d <= 4.0 for d in a + b)
    assert len(set(a)) > 190


@pytest.mark.parametrize("attempt, base, cap", [
    (-1, 1.0, 15.0), (True, 1.0, 15.0), (1.5, 1.0, 15.0), (0, 0.0, 15.0), (0, -1.0, 15.0), (0, math.nan, 15.0),
    (0, 1.0, 0.5), (0, 1.0, math.inf), (0, 1.0, math.nan), (0, 1.0, 10**6),
])
def test_out_of_range_arguments_are_refused(attempt, base, cap):
    with pytest.raises(ValueError):
        full_jitter(attempt, base, cap)


def test_a_backoff_counts_its_attempts_and_starts_again_after_reset():
    class Top(random.Random):  # always the window's upper end, to read which window was drawn from
        def uniform(self, a: float, b: float) -> float:
            return b

    b = Backoff(1.0, 8.0, rng=Top())
    assert [b.next_s() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    b.reset()
    assert b.next_s() == 1.0
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)


def test_paho_waits_exactly_the_draw_before_its_next_reconnect():
    """paho-mqtt's client doubles its own delay between min and max; paho_next_delay sets both to the draw and
    clears the doubling, so the next _reconnect_wait waits exactly the draw (read back from the real client)."""
    import paho.mqtt.client as mqtt

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    backoff = Backoff(1.0, 15.0, rng=random.Random(7))
    waits = []
    for _ in range(5):
        delay = paho_next_delay(client, backoff)
        assert 0.0 <= delay <= 15.0
        client._state = mqtt._ConnectionState.MQTT_CS_DISCONNECTING  # paho then returns without sleeping
        client._reconnect_wait()
        waits.append(client._reconnect_delay)
        assert client._reconnect_delay == delay
    assert len(set(waits)) == 5
