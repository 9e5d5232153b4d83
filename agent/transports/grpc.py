"""The Open Inference Protocol over gRPC (KServe v2 / Triton's ``inference.GRPCInferenceService``).

What ``tritonclient.grpc`` needs of a server: ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata,
ModelConfig, ModelInfer (tensors in ``raw_input_contents``, typed ``contents`` or system shared memory; outputs in
``raw_output_contents`` or shared memory), the system shared-memory calls (agent/transports/shm.py, shared with
HTTP), ModelStatistics and RepositoryIndex (what perf_analyzer asks): every call HTTP answers. RepositoryModelLoad
and RepositoryModelUnload answer UNAVAILABLE, as Triton's do when its model control is not explicit: the agent
loads what its fleet's desired state says, never at a local client's word. CUDA shared memory: status and
unregister answer as for no region registered (as over HTTP), register INVALID_ARGUMENT. Other calls (streaming,
trace and log settings) answer UNIMPLEMENTED.
Requests are decoded by the same code as HTTP's (agent/transports/kserve.py)
and queue in the same batcher: a gRPC request and an HTTP request can share a batch.

gRPC's asyncio server runs on the agent's event loop (grpc.aio): a request is decoded there and queued in the
batcher like an HTTP one, with no thread hand-off (a server on threads that handed each request to the loop
served digits at a third of the rate, measured with bench/serve.py). Messages are capped at ``max_message_bytes``
(the agent's max_body_bytes), and gRPC receives a call's whole message before the agent sees it, so the memory
its calls hold is bounded by how many may be in progress at once: ``grpc_concurrency`` (max_inflight_body_bytes
/ max_body_bytes, at least 64 and at most 1024; 64 calls of up to 16 MiB at the defaults); beyond that gRPC
answers RESOURCE_EXHAUSTED.

Connections (issue 45.1): gRPC core listens on a Unix socket in a private folder, and the public port is a front
(agent/transports/grpc_front.py) that splices each connection it admits to it. At most ``grpc_max_connections`` at
once (and never more than a twelfth of the process's descriptor limit, RLIMIT_NOFILE: each takes three, the
client's and both ends of the inner one, so a quarter of the table at most), of them at most
``grpc_max_connections_per_peer`` from one address (half the cap by default): one more from that address is
closed as it is accepted, and at the total cap the connection with no call in progress for the longest is closed
to make room. gRPC core's own options bound each inner connection: one that has not sent HTTP/2's preface and
SETTINGS within ``grpc_handshake_timeout_s`` is closed; one with no call in progress for ``grpc_idle_timeout_s``
is sent GOAWAY and closed (a client's channel reconnects by itself); request metadata over
``GRPC_MAX_METADATA_BYTES`` is refused; pings without calls are refused past gRPC's default strikes (keepalive
enforcement). A client that reads none of its answers for ``grpc_handshake_timeout_s`` is cut off. On loopback a
peer's address tells little (a local user picks any source in 127.0.0.0/8, so the total cap and its room for new
connections are what hold there); the local socket has a cap per user.
Every error is a gRPC status with a message: INVALID_ARGUMENT (a bad request),
NOT_FOUND (no such model), RESOURCE_EXHAUSTED (a full queue), UNAVAILABLE (no model yet, being replaced, queue
timeout), INTERNAL.

grpcio and the service's message classes (from ``tritonclient[grpc]``) are imported only when gRPC is on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import protocol
from ...engines import NP_DTYPES
from ...protocol.errors import ConfigError
from ..core.host import EXTENSIONS, ModelHost, Served, model_config
from ..errors import AgentError, RequestError
from .grpc_front import GrpcFront
from .kserve import (
    CUDA_SHM_REFUSED,
    MODEL_CONTROL_REFUSED,
    InferRequest,
    decode_request,
    ordered_outputs,
)
from .peer import PeerCell, tcp_peer
from .shm import SharedMemory

__all__ = ["GrpcLimits", "GrpcServer", "grpc_concurrency", "grpc_limits"]

log = logging.getLogger("edgefleet.agent.grpc")

# InferTensorContents' field for each datatype (typed, non-raw inputs)
_CONTENTS = {"FP32": "fp32_contents", "INT64": "int64_contents", "INT32": "int_contents", "INT8": "int_contents",
             "UINT8": "uint_contents", "BOOL": "bool_contents"}


def _param_value(p: Any) -> Any:
    kind = p.WhichOneof("parameter_choice")
    return None if kind is None else getattr(p, kind)


def _params(m: Any) -> dict[str, Any]:
    return {k: _param_value(v) for k, v in m.items()}


def request_doc(request: Any) -> tuple[dict[str, Any], dict[str, memoryview]]:
    """A ModelInferRequest -> the JSON-shaped request agent/transports/kserve.py decodes, and each raw input's bytes."""
    raw: dict[str, memoryview] = {}
    inputs = []
    k = 0
    for t in request.inputs:
        params = _params(t.parameters)
        d: dict[str, Any] = {"name": t.name, "shape": list(t.shape), "datatype": t.datatype, "parameters": params}
        if "shared_memory_region" not in params:
            if k < len(request.raw_input_contents):
                content = request.raw_input_contents[k]
                k += 1
                params["binary_data_size"] = len(content)
                raw[t.name] = memoryview(content)
            elif t.HasField("contents"):
                field = _CONTENTS.get(t.datatype)
                if field is None:
                    raise RequestError(f"input {t.name!r}: {t.datatype} goes in raw_input_contents, not contents")
                d["data"] = list(getattr(t.contents, field))
            elif "binary_data_size" in params:  # HTTP's parameter: over gRPC the bytes are raw_input_contents
                raise RequestError(f"input {t.name!r}: binary_data_size is given but no raw_input_contents is left "
                                   "for it; over gRPC a tensor's bytes go in raw_input_contents, one per input "
                                   "without shared memory, in the inputs' order")
        inputs.append(d)
    if k != len(request.raw_input_contents):
        raise RequestError(f"{len(request.raw_input_contents)} raw_input_contents for {k} inputs without shared memory")
    doc: dict[str, Any] = {"inputs": inputs, "parameters": _params(request.parameters)}
    for key in ("sequence_start", "sequence_end", "sequence_id"):
        doc["parameters"].pop(key, None)  # tritonclient's defaults; the agent serves no sequence models
    if request.id:
        doc["id"] = request.id
    if request.outputs:
        doc["outputs"] = [{"name": o.name, "parameters": _params(o.parameters)} for o in request.outputs]
    return doc, raw


_CODES = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED",
          429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}


GRPC_MIN_CONCURRENCY, GRPC_MAX_CONCURRENCY = 64, 1024
GRPC_MAX_METADATA_BYTES = 16 * 1024  # a call's metadata (headers); gRPC core's own default soft limit is 8 KiB


@dataclass(frozen=True)
class GrpcLimits:
    """The bounds of gRPC's connections (the agent's grpc_* settings)."""

    max_connections: int = 256
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    max_connections_per_peer: int | None = None  # None: half of connection_cap

    def connection_cap(self) -> int:
        """max_connections, at most a twelfth of the soft descriptor limit (at least 1): three descriptors each."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return self.max_connections if soft == resource.RLIM_INFINITY else max(1, min(self.max_connections,
                                                                                      soft // 12))

    def per_peer_cap(self, cap: int) -> int:
        return min(cap, self.max_connections_per_peer or max(1, cap // 2))

    def options(self, cap: int) -> list[tuple[str, int]]:
        """gRPC core's channel arguments for these bounds. Only the front reaches its socket: its cap is the
        front's with room for connections being replaced (one closed for a new one is still open for a moment)."""
        return [("grpc.max_allowed_incoming_connections", 2 * cap),
                ("grpc.server_handshake_timeout_ms", int(self.handshake_timeout_s * 1000)),
                ("grpc.max_connection_idle_ms", int(self.idle_timeout_s * 1000)),
                ("grpc.max_metadata_size", GRPC_MAX_METADATA_BYTES),
                ("grpc.absolute_max_metadata_size", GRPC_MAX_METADATA_BYTES)]


def grpc_limits(config: Any) -> GrpcLimits:
    """The agent's config (agent.config.AgentConfig) -> its gRPC connection bounds."""
    return GrpcLimits(config.grpc_max_connections, config.grpc_handshake_timeout_s, config.grpc_idle_timeout_s,
                      config.grpc_max_connections_per_peer)


def grpc_concurrency(max_inflight_body_bytes: int, max_body_bytes: int) -> int:
    """How many gRPC calls may be in progress at once: as many whole messages as fit in the in-flight budget
    (HTTP's bound, which HTTP charges as bytes arrive), at least 64 and at most 1024."""
    return min(GRPC_MAX_CONCURRENCY, max(GRPC_MIN_CONCURRENCY, max_inflight_body_bytes // max_body_bytes))


class GrpcServer:
    def __init__(self, host: ModelHost, shm: SharedMemory | None, device_id: str, max_message_bytes: int,
                 max_concurrent_rpcs: int = GRPC_MIN_CONCURRENCY, limits: GrpcLimits | None = None):
        self.host, self.shm, self.device_id = host, shm, device_id
        self.limits = limits or GrpcLimits()
        self.max_message_bytes = max_message_bytes
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self._server: Any = None
        self._front: GrpcFront | None = None
        self._folder: str | None = None
        self.port = 0
        self.bind_host: str | None = None

    async def start(self, bind_host: str, port: int) -> int:
        """Listen on ``bind_host:port`` (0: a free port) -> the port. On the event loop that serves."""
        try:
            import grpc  # type: ignore[import-untyped]
            from tritonclient.grpc import service_pb2, service_pb2_grpc  # type: ignore[import-untyped]
        except ImportError as exc:
            raise ConfigError(f"grpc_port: gRPC needs grpcio and tritonclient's service messages, install "
                              f"edgefleet[grpc] ({exc})") from exc

        self._grpc, self._pb = grpc, service_pb2
        cap = self.limits.connection_cap()
        opts = [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", max(self.max_message_bytes, 64 * 1024 * 1024)),
                *self.limits.options(cap)]
        server = grpc.aio.server(options=opts, maximum_concurrent_rpcs=self.max_concurrent_rpcs)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(self, service_pb2_grpc), server)
        self._folder = tempfile.mkdtemp(prefix="edgefleet-grpc-")  # mode 0700: the front alone reaches the socket
        inner = os.path.join(self._folder, "grpc.sock")
        try:
            if not server.add_insecure_port(f"unix:{inner}"):
                raise OSError(f"gRPC could not listen on {inner}")
            await server.start()
            self._server = server
            front = GrpcFront(inner, cap, self.limits.per_peer_cap(cap), self.limits.handshake_timeout_s,
                              sending_per_peer=max(4, self.max_concurrent_rpcs // 4))
            self.port = await front.start(bind_host, port)
        except BaseException:
            await self.stop(0)
            raise
        self._front = front
        self.bind_host = bind_host
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Stop taking calls; the calls in progress get ``grace_s`` to finish."""
        if self._front is not None:
            self._front.stop_accepting()
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._front is not None:
            await self._front.stop()
            self._front = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    # -- helpers ------------------------------------------------------------------------------------

    def caller_shm(self, context: Any) -> tuple[SharedMemory | None, PeerCell]:
        """The shared-memory registry as this call's client may use it, and the client's cell
        (agent/transports/peer.py). gRPC shows no connection, only its peer (the front's inner connection, mapped
        back to the client's address), and an address and port may be another user's once the connection closes:
        the user is told per call, and only when the call uses a region (about 25-50 us)."""
        origin = self._front.origin(context.peer()) if self._front is not None else None
        host, port, reached = origin or (None, None, None)
        cell = PeerCell(lambda: tcp_peer(host, port, self.port, reached))
        return (None if self.shm is None else self.shm.as_caller(cell)), cell

    def served(self, name: str, version: str) -> Served:
        return self.host.get(name, version or None)

    async def abort(self, context: Any, exc: BaseException) -> None:
        grpc = self._grpc
        if isinstance(exc, AgentError):
            code = getattr(grpc.StatusCode, _CODES.get(getattr(exc, "status_code", 500), "INTERNAL"))
            await context.abort(code, str(exc))
        log.error("unexpected error in a gRPC call: %r", exc)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc}")

    async def infer(self, request: Any, context: Any) -> Any:
        t0 = time.perf_counter()
        served: Served | None = None
        status = 500
        try:
            served = self.served(request.model_name, request.model_version)
            m = served.manifest
            doc, raw = request_doc(request)
            shm = self.caller_shm(context)[0] if self.shm is not None else None
            req = decode_request(doc, m.inputs, m.outputs, raw=raw, shm=shm)
            outs = await self.host.infer(served, req)
            response = self._response(m.name, m.version, outs, m.outputs, req, shm)
            status = 200
            return response
        except asyncio.CancelledError:
            status = 499  # the client cancelled the call (or its deadline passed): not this agent's error
            raise
        except AgentError as exc:
            status = getattr(exc, "status_code", 500)
            await self.abort(context, exc)
        except Exception as exc:
            if type(exc).__module__.startswith("grpc"):  # context.abort's own exception
                raise
            await self.abort(context, exc)
        finally:
            self.host.record(served, None, time.perf_counter() - t0, status)

    def _response(self, model: str, version: str, outputs: list[np.ndarray], specs: Any, req: InferRequest,
                  shm: SharedMemory | None) -> Any:
        pb = self._pb
        resp = pb.ModelInferResponse(model_name=model, model_version=version, id=req.id or "")
        for name, arr, spec in ordered_outputs(outputs, specs, req):
            data = np.ascontiguousarray(arr, dtype=np.dtype(NP_DTYPES[spec.datatype]).newbyteorder("<"))
            t = resp.outputs.add(name=name, datatype=spec.datatype, shape=list(arr.shape))
            if name in req.shm_outputs:
                assert shm is not None
                region, off, size = req.shm_outputs[name]
                n = shm.write(region, off, size, data, f"output {name!r}")
                t.parameters["shared_memory_region"].string_param = region
                t.parameters["shared_memory_byte_size"].int64_param = n
                if off:
                    t.parameters["shared_memory_offset"].int64_param = off
                resp.raw_output_contents.append(b"")  # keeps raw_output_contents[i] the i-th output's
            else:
                resp.raw_output_contents.append(data.tobytes())
        return resp


class _Servicer:
    """Bound to ``service_pb2_grpc.GRPCInferenceServiceServicer`` at start (grpcio is imported lazily)."""

    def __new__(cls, srv: GrpcServer, service_pb2_grpc: Any) -> Any:
        pb = srv._pb
        base = service_pb2_grpc.GRPCInferenceServiceServicer

        class Servicer(base):  # type: ignore[misc, valid-type]
            async def ServerLive(self, request: Any, context: Any) -> Any:
                return pb.ServerLiveResponse(live=True)

            async def ServerReady(self, request: Any, context: Any) -> Any:
                return pb.ServerReadyResponse(ready=srv.host.ready())

            async def ServerMetadata(self, request: Any, context: Any) -> Any:
                return pb.ServerMetadataResponse(name="edgefleet-agent", version=protocol.__version__,
                                                 extensions=EXTENSIONS)

            async def ModelReady(self, request: Any, context: Any) -> Any:
                try:
                    srv.served(request.name, request.version)
                except AgentError:
                    return pb.ModelReadyResponse(ready=False)
                return pb.ModelReadyResponse(ready=True)

            async def ModelMetadata(self, request: Any, context: Any) -> Any:
                try:
                    served = srv.served(request.name, request.version)
                except AgentError as exc:
                    await srv.abort(context, exc)
                m = served.manifest
                T = pb.ModelMetadataResponse.TensorMetadata
                return pb.ModelMetadataResponse(
                    name=m.name, versions=[m.version], platform=m.backend,
                    inputs=[T(name=s.name, datatype=s.datatype, shape=list(s.shape)) for s in m.inputs],
                    outputs=[T(name=s.name, datatype=s.datatype, shape=list(s.shape)) for s in m.outputs])

            async def ModelConfig(self, request: Any, context: Any) -> Any:
                from google.protobuf import json_format  # type: ignore[import-untyped]
                from tritonclient.grpc import model_config_pb2  # type: ignore[import-untyped]

                try:
                    served = srv.served(request.name, request.version)
                except AgentError as exc:
                    await srv.abort(context, exc)
                doc = model_config(served, srv.host.version_number(served))
                cfg = json_format.ParseDict(doc, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
                return pb.ModelConfigResponse(config=cfg)

            async def ModelStatistics(self, request: Any, context: Any) -> Any:
                from google.protobuf import json_format

                try:
                    if request.name:
                        models = [srv.served(request.name, request.version)]
                    else:
                        models = [s for _, s in sorted(srv.host.models.items())]
                except AgentError as exc:
                    await srv.abort(context, exc)
                return pb.ModelStatisticsResponse(model_stats=[json_format.ParseDict(
                    srv.host.model_stats(s), pb.ModelStatistics(), ignore_unknown_fields=True) for s in models])

            async def RepositoryIndex(self, request: Any, context: Any) -> Any:
                entry = pb.RepositoryIndexResponse.ModelIndex
                return pb.RepositoryIndexResponse(models=[entry(**e) for e in srv.host.repository_index(request.ready)])

            async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
                await context.abort(srv._grpc.StatusCode.UNAVAILABLE, MODEL_CONTROL_REFUSED)

            async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
                await context.abort(srv._grpc.StatusCode.UNAVAILABLE, MODEL_CONTROL_REFUSED)

            async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
                if request.name:
                    await context.abort(srv._grpc.StatusCode.INVALID_ARGUMENT,
                                        f"no CUDA shared-memory region {request.name!r} is registered")
                return pb.CudaSharedMemoryStatusResponse()

            async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
                await context.abort(srv._grpc.StatusCode.INVALID_ARGUMENT, CUDA_SHM_REFUSED)

            async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
                return pb.CudaSharedMemoryUnregisterResponse()

            async def ModelInfer(self, request: Any, context: Any) -> Any:
                return await srv.infer(request, context)

            async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
                resp = pb.SystemSharedMemoryStatusResponse()
                if srv.shm is None:
                    await srv.abort(context, RequestError("system shared memory is off on this agent"))
                    return resp
                try:
                    view = srv.caller_shm(context)[0]
                    assert view is not None
                    regions = view.status(request.name or None)
                except AgentError as exc:
                    await srv.abort(context, exc)
                for r in regions:
                    resp.regions[str(r["name"])].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**r))
                return resp

            async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
                if srv.shm is None:
                    await srv.abort(context, RequestError("system shared memory is off on this agent"))
                    return None
                try:
                    peer = srv.caller_shm(context)[1].get()
                    # max_shm_regions_per_client counts each local user apart, by its user alone (as over HTTP: not
                    # by its source address, which a local user picks from 127.0.0.0/8)
                    srv.shm.register(request.name, request.key, request.offset, request.byte_size,
                                     f"uid {peer.uid}", peer)
                except AgentError as exc:
                    await srv.abort(context, exc)
                return pb.SystemSharedMemoryRegisterResponse()

            async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
                view = srv.caller_shm(context)[0]
                if view is not None:
                    try:
                        view.unregister(request.name or None)
                    except AgentError as exc:
                        await srv.abort(context, exc)
                return pb.SystemSharedMemoryUnregisterResponse()

        return Servicer()

