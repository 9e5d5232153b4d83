"""onnxruntime target: FP32 (the source graph, optimized) or static INT8 in QDQ format.

Dynamic quantization is never chosen: on CPU it makes conv nets 5-12x slower (measured here).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from compiler.data import Dataset
from compiler.errors import InputError, ToolchainError
from compiler.graph import GraphInfo
from compiler.targets.base import Runner
from protocol.profile import HardwareProfile

__all__ = ["OnnxRuntimeTarget"]


class _Reader:
    """onnxruntime CalibrationDataReader over a Dataset, in small batches."""

    def __init__(self, data: Dataset, batch: int = 16):
        self._data = data
        self._batch = batch
        self._i = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._i >= len(self._data):
            return None
        s = slice(self._i, self._i + self._batch)
        self._i += self._batch
        return {k: v[s] for k, v in self._data.inputs.items()}

    def rewind(self) -> None:
        self._i = 0


class OnnxRuntimeTarget:
    backend = "onnxruntime"
    engine_suffix = ".onnx"

    def build(self, source: Path, info: GraphInfo, precision: str, profile: HardwareProfile,
              calibration: Dataset | None, out_path: Path) -> None:
        if precision == "fp32":
            shutil.copyfile(source, out_path)
            return
        if precision != "int8":
            raise InputError(f"onnxruntime target builds fp32 or int8, not {precision}")
        if calibration is None:
            raise InputError("static INT8 quantization needs a calibration set (--calibration)")
        q = profile.quantization
        if q.method != "static":
            raise InputError(f"profile {profile.name}: int8 needs quantization.method 'static'")
        try:
            from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
            from onnxruntime.quantization.shape_inference import quant_pre_process
        except ImportError as exc:
            raise ToolchainError("onnxruntime.quantization is not importable; install edgefleet[compiler]") from exc
        method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                  "percentile": CalibrationMethod.Percentile}[q.calibration_method]
        with tempfile.TemporaryDirectory(prefix="edgefleet-quant-") as tmp:
            pre = Path(tmp) / "pre.onnx"
            try:
                quant_pre_process(str(source), str(pre), skip_symbolic_shape=True)
                quantize_static(
                    str(pre), str(out_path), _Reader(calibration.head(q.max_calibration_samples)),
                    quant_format=QuantFormat.QDQ, per_channel=q.per_channel,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=method,
                    extra_options={"CalibTensorRangeSymmetric": False},
                )
            except Exception as exc:
                raise ToolchainError(f"onnxruntime static quantization failed: {exc}") from exc

    def runner(self, engine: Path, profile: HardwareProfile) -> Runner:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = profile.runtime.intra_op_threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        sess = ort.InferenceSession(str(engine), so, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]

        def run(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
            return list(sess.run(names, feed))

        return run

    def toolchain_versions(self) -> dict[str, str]:
        import onnx
        import onnxruntime

        return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
