"""Instances kept busy (issue 32.3): with several instances, no request waits while an instance is idle. The real
agent on loopback, an operator's layout of two one-thread instances, each instance's runtime held at a gate of its
own; events and bounded polling, no timing thresholds."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np

from tests.agent_harness import on_loop, preinstall, running_agent
from tests.conftest import wait_for

DIGITS_EVAL = Path(__file__).resolve().parent.parent / "models" / "digits" / "test.npz"


@contextmanager
def held_apart(a):
    """Each digits instance held at a gate of its own (its batches wait in the runtime until its gate opens, at most
    60 s) -> (the gates, the calls each instance has entered)."""
    served = on_loop(a, lambda: a.host.models["digits"])
    gates = [threading.Event() for _ in served.backends]
    entered = [0] * len(served.backends)
    lock = threading.Lock()
    for i, be in enumerate(served.backends):
        real = be.infer

        def infer(feeds, real=real, i=i):
            with lock:
                entered[i] += 1
            gates[i].wait(60)
            return real(feeds)

        be.infer = infer
    try:
        yield gates, entered
    finally:
        for g in gates:
            g.set()
        for be in served.backends:
            del be.infer


def requests_held(b) -> int:
    """Requests a batcher holds, each once: queued, in a batch waiting behind a running one, or running
    (agent_harness.in_batcher counts a waiting batch's samples twice: queued and running)."""
    return len({id(p) for batch in b._running.values() for p in batch}
               | {id(p) for q in b._queues for p in q if not p.future.done()})


def body(img: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "shape": [1, *img.shape], "datatype": "FP32",
                                   "data": img.reshape(-1).tolist()}]}).encode()


def test_a_free_instance_takes_the_requests_waiting_behind_a_held_one(tmp_path, digits_bundle):
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    with np.load(DIGITS_EVAL) as npz:
        images = npz["input"][:8].astype(np.float32)
    settings = {"instances": 2, "intra_op_threads": 1, "max_batch_size": 4, "queue_timeout_ms": 60_000}
    with running_agent(data, **settings) as (agent, url), ThreadPoolExecutor(8) as pool:
        batcher = on_loop(agent, lambda: agent.host.models["digits"].batcher)
        answered: list[int] = []

        def send(img: np.ndarray) -> int:
            r = httpx.post(f"{url}/v2/models/digits/infer", content=body(img), timeout=60)
            answered.append(r.status_code)
            return r.status_code

        with held_apart(agent) as (gates, entered):
            futs = [pool.submit(send, images[0])]
            wait_for(lambda: entered[0] + entered[1] == 1, 20, "the first request in an instance")
            futs.append(pool.submit(send, images[1]))
            wait_for(lambda: entered == [1, 1], 20, "both instances running a request")
            for k, img in enumerate(images[2:], start=3):  # one by one, each queued behind the held instances
                futs.append(pool.submit(send, img))
                wait_for(lambda k=k: on_loop(agent, lambda: requests_held(batcher)) == k, 20,
                         f"{k} requests in the batcher")
            held = 0 if entered[0] else 1
            gates[1 - held].set()
            wait_for(lambda: len(answered) == 7, 20,
                     "every request but the held one answered while one instance was free")
            assert entered[held] == 1  # nothing more ran on the held instance
        assert [f.result(60) for f in futs] == [200] * 8
