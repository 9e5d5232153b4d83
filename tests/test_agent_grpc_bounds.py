"""gRPC from the outside: the memory its calls hold is bounded. A module of its own, so that no other agent's event
loop is alive beside its agent's while it runs (grpc.aio binds every live loop to one shared poller)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.agent_harness import gated, preinstall, running_agent

grpc = pytest.importorskip("grpc", reason="gRPC needs edgefleet[grpc]")
pytest.importorskip("tritonclient.grpc", reason="gRPC needs edgefleet[grpc]")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

from tests.waiting import wait_for, watch  # noqa: E402

OUT_BYTES = 4 * 10 * 4


def grpc_infer_request(x):
    req = service_pb2.ModelInferRequest(model_name="digits")
    req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req


MORE_REFUSALS_S = 0.5  # the time more refusals are given to come once the first has: an absence, not a wait


def test_grpc_calls_in_progress_are_bounded_by_the_inflight_budget(tmp_path, digits_bundle, test_images):
    """gRPC reads a call's whole message before the agent sees it, so its memory is bounded only by the calls in
    progress: at most max_inflight_body_bytes / max_body_bytes of them (at least 64). Before, 1,024 calls of up
    to max_body_bytes each (16 GiB at the defaults) could be held; here the bound is 70 and 76 calls wait on a
    held model: gRPC's own counter admits the bound and a few more (72 or 73 in runs here), the rest are refused
    with RESOURCE_EXHAUSTED."""
    preinstall(tmp_path, digits_bundle)
    with running_agent(tmp_path, grpc_port=0, max_body_bytes=64 * 1024, max_inflight_body_bytes=70 * 64 * 1024,
                       queue_timeout_ms=60_000) as (a, url):
        ch = grpc.insecure_channel(f"127.0.0.1:{a.grpc_port}")
        try:
            st = service_pb2_grpc.GRPCInferenceServiceStub(ch)
            x = np.ascontiguousarray(test_images[0][:4], np.float32)
            with gated(a):
                calls = [st.ModelInfer.future(grpc_infer_request(x), timeout=30) for _ in range(76)]
                wait_for(lambda: any(c.done() for c in calls), 20, "a call refused", interval_s=0.02)
                watch(lambda: sum(c.done() for c in calls) > 6, MORE_REFUSALS_S)
                refused = [c for c in calls if c.done()]
                assert 1 <= len(refused) <= 6, (f"{len(refused)} calls ended while the model was held: "
                                                f"{sorted(str(c.code()) for c in refused)}")
                for c in refused:
                    assert c.exception() is not None and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, c
            admitted = [c for c in calls if c not in refused]
            for c in admitted:  # the gate opened: every admitted call answered exactly
                assert len(c.result(timeout=30).raw_output_contents[0]) == OUT_BYTES
        finally:
            ch.close()
