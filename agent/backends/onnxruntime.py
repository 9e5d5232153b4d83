"""onnxruntime backend (x86 and the universal CPU fallback)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agent.backends.base import Backend
from agent.errors import BackendError

__all__ = ["OnnxRuntimeBackend"]


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def load(self, engine: Path, threads: int) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise BackendError("onnxruntime is not installed; install edgefleet[agent]") from exc
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # idle spinning threads steal CPU from the HTTP front end (measured here: 20-50% at 32 clients)
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self._sess = ort.InferenceSession(str(engine), so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise BackendError(f"onnxruntime could not load {engine.name}: {exc}") from exc
        have = {i.name for i in self._sess.get_inputs()}
        want = {s.name for s in self.inputs}
        if have != want:
            raise BackendError(f"engine inputs {sorted(have)} differ from the manifest's {sorted(want)}")
        self._out_names = [o.name for o in self.outputs]

    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return list(self._sess.run(self._out_names, feeds))

    def close(self) -> None:
        self._sess = None
