"""onnxruntime target: FP32 (the source graph) or static INT8 in QDQ format.

Dynamic quantization is never chosen: on CPU it makes conv nets 5-12x slower (measured here).

The INT8 layout follows the profile's promise, never the build host (``HardwareProfile.int8_scheme``):
full-range int8 weights against uint8 activations saturate the 16-bit pairwise sums of the AVX2
kernels on CPUs without VNNI, so a profile that admits such CPUs gets 7-bit weights (onnxruntime's
``reduce_range``) or uint8 weights. With either, the integer arithmetic is exact on every x86 CPU,
and the engine computes the same outputs with VNNI, on AVX2 alone and without AVX.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from ...engines.onnxruntime import session_options
from ...judge.data import Dataset
from ...protocol.manifest import Int8Scheme, QuantizationInfo
from ...protocol.profile import HardwareProfile
from ..batch import fixed_input_batch
from ..buildnotes import note
from ..errors import InputError, ToolchainError
from ..graph import GraphInfo, all_nodes, is_quantized_op

__all__ = ["OnnxRuntimeTarget"]


class _Reader:
    """onnxruntime CalibrationDataReader over a Dataset, in small batches."""

    def __init__(self, data: Dataset, batch: int = 16, fixed: int | None = None):
        """``fixed``: the model runs exactly this batch (compiler.batch): feeds of that size, the last padded with
        copies of its last sample."""
        self._data = data
        self._batch = 1 if data.per_sample else fixed or batch
        self._fixed = fixed
        self._i = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._i >= len(self._data):
            return None
        feed = self._data.take(self._i, self._i + self._batch)
        self._i += self._batch
        if self._fixed is not None:
            feed = {k: v if (a := self._data.axes.get(k, 0)) is None or v.shape[a] == self._fixed else
                    np.concatenate([v, np.repeat(np.take(v, [-1], axis=a), self._fixed - v.shape[a], axis=a)], axis=a)
                    for k, v in feed.items()}
        return feed

    def rewind(self) -> None:
        self._i = 0


QDQ_MIN_OPSET = 13  # per-channel QuantizeLinear/DequantizeLinear (the axis attribute) needs opset 13


class OnnxRuntimeTarget:
    qdq_int8_min_opset: int | None = QDQ_MIN_OPSET
    builds_with_reference_runtime = True
    float_build_needs_samples = False

    def build(self, source: Path, info: GraphInfo, precision: str, profile: HardwareProfile,
              calibration: Dataset | None, out_path: Path) -> QuantizationInfo | None:
        if precision == "fp32":
            optimize_offline(source, out_path)
            return None
        if precision != "int8":
            raise InputError(f"onnxruntime target builds fp32 or int8, not {precision}")
        if calibration is None:
            raise InputError("static INT8 quantization needs a calibration set (--calibration)")
        with tempfile.TemporaryDirectory(prefix="edgefleet-quant-") as tmp:
            prepared, how = prepare_or_raw(source, Path(tmp) / "prepared.onnx")
            quant = quantize(prepared, profile, calibration, out_path)
        ops = check_quantized(out_path)
        return quant.model_copy(update={"reason": f"{quant.reason}; {how}; {ops} quantize/dequantize ops"})

    def prepare_float(self, source: Path, out_path: Path) -> Path:
        return prepare(source, out_path)

    def build_int8_keeping_float(self, prepared: Path, profile: HardwareProfile, calibration: Dataset, out_path: Path,
                                 keep_float: tuple[str, ...], scheme: Int8Scheme | None = None) -> QuantizationInfo:
        return quantize(prepared, profile, calibration, out_path, keep_float=keep_float, scheme=scheme)

    def full_weight_scheme(self, profile: HardwareProfile) -> Int8Scheme | None:
        return FULL_WEIGHTS_EXACT if profile.int8_scheme()[0] == "u8s8_reduced" else None

    def toolchain_versions(self) -> dict[str, str]:
        import onnx
        import onnxruntime

        return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}

    def engine_compatibility(self) -> dict[str, str]:
        return {}


def prepare(source: Path, out_path: Path) -> Path:
    """The float model as the quantizer sees it (shape inference, fusions), with every node named:
    the float fallback excludes nodes by these names."""
    return prepare_or_raw(source, out_path)[0]


def prepare_or_raw(source: Path, out_path: Path) -> tuple[Path, str]:
    """:func:`prepare`, and which path it took: onnxruntime's ``quant_pre_process`` (shape inference and
    fusions), or, when that fails on a graph (it does on some real exports, e.g. "The truth value of an array
    ... is ambiguous"), the raw graph as it is, which ``quantize_static`` can still quantize."""
    from ..graph import name_nodes

    try:
        from onnxruntime.quantization.shape_inference import quant_pre_process
    except ImportError as exc:
        raise ToolchainError("onnxruntime.quantization is not importable; install edgefleet[compiler]") from exc
    try:
        with contextlib.redirect_stdout(sys.stderr):
            quant_pre_process(str(source), str(out_path), skip_symbolic_shape=True)
        how = "quantized after onnxruntime's quant_pre_process"
    except Exception as exc:  # onnxruntime raises assorted types from its pre-processing
        shutil.copyfile(source, out_path)
        first = " ".join(str(exc).split())[:160] or type(exc).__name__
        how = f"quantized from the raw graph (onnxruntime's quant_pre_process failed: {first})"
        note("int8 pre-processing", "quantized from the raw graph", f"onnxruntime's quant_pre_process failed: {first}")
    gemm_biases_1d(out_path)
    return name_nodes(out_path, out_path), how


def gemm_biases_1d(path: Path) -> list[str]:
    """Give every Gemm whose bias C is a constant broadcast along the rows ([1, N], [1, 1], [1] or a scalar) a 1-D
    bias [N] of the same values, in place; the names of the biases changed. The output is the same (Gemm broadcasts
    C to [M, N] either way). onnxruntime's per-channel quantizer indexes a bias per output channel: on a 2-D bias its
    int32-bias weight adjustment crashes ("The truth value of an array ... is ambiguous"), and without that
    adjustment (QDQDisableWeightAdjustForInt32Bias) it writes a per-axis DequantizeLinear whose scale ([N]) does not
    fit the bias's axis 0 (1): "For per axis quantization, scale must be 1D tensor with size 1" at run time, which
    failed every float fallback build of such a model."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    inits = {t.name: t for t in model.graph.initializer}
    users: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            users[i] = users.get(i, 0) + 1
    changed = []
    for n in model.graph.node:
        if n.op_type != "Gemm" or len(n.input) < 3 or n.input[2] not in inits or n.input[1] not in inits:
            continue
        c = numpy_helper.to_array(inits[n.input[2]])
        b_dims = list(inits[n.input[1]].dims)
        trans_b = next((a.i for a in n.attribute if a.name == "transB"), 0)
        if len(b_dims) != 2 or (c.ndim == 1 and c.size == b_dims[0 if trans_b else 1]):
            continue
        width = b_dims[0 if trans_b else 1]
        if c.ndim > 2 or (c.ndim == 2 and c.shape[0] != 1) or (c.size not in (1, width)):
            continue
        flat = numpy_helper.from_array(np.ascontiguousarray(np.broadcast_to(c.reshape(-1), (width,))),
                                       f"{n.input[2]}_1d" if users[n.input[2]] > 1 else n.input[2])
        if users[n.input[2]] > 1:
            model.graph.initializer.append(flat)
            n.input[2] = flat.name
        else:
            inits[n.input[2]].CopyFrom(flat)
        changed.append(flat.name)
    if changed:
        onnx.save(model, str(path))
        note("int8 pre-processing", f"{len(changed)} Gemm bias(es) made 1-D [N] ({', '.join(changed[:8])})",
             "onnxruntime's per-channel quantizer reads a bias per output channel: a [1, N] bias crashes its int32 "
             "bias adjustment and, without it, gives a DequantizeLinear whose scale does not fit the bias")
    return changed


CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def count_quantized_ops(path: Path) -> tuple[int, int, int]:
    """(quantized ops, compute ops inside If/Loop/Scan subgraphs, all compute ops) of an ONNX model,
    subgraphs included: a QDQ or QOperator model has QuantizeLinear/DequantizeLinear or QLinear* nodes."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    every = all_nodes(model.graph)
    inner = [n for node in model.graph.node for a in node.attribute
             for g in ([a.g] if a.HasField("g") else []) + list(a.graphs) for n in all_nodes(g)]
    quantized = sum(is_quantized_op(n.op_type) for n in every)
    compute = lambda nodes: sum(n.op_type not in CONTROL_FLOW for n in nodes)  # noqa: E731
    return quantized, compute(inner), compute(every)


def check_quantized(path: Path) -> int:
    """The number of quantized ops in a built int8 engine; none is an error that says why (the engine would be
    fp32 under an int8 label)."""
    quantized, inside, total = count_quantized_ops(path)
    if quantized:
        return quantized
    why = (f"{inside} of its {total} ops sit inside If/Loop/Scan subgraphs, which onnxruntime's static "
           "quantizer leaves in float" if inside else "no op onnxruntime's quantizer handles was found")
    raise ToolchainError(f"the int8 build has no quantized op (0 QuantizeLinear/DequantizeLinear/QLinear nodes, "
                         f"subgraphs included): {why}; it would be fp32 labelled int8, so it is not shipped as int8 "
                         "(compile with --precision fp32, or auto, which ships fp32 and says why)")


# 8-bit weights that compute exactly on every x86 CPU, VNNI or not: the scheme a failed 7-bit build tries next
FULL_WEIGHTS_EXACT: Int8Scheme = "u8u8"


def quantize(prepared: Path, profile: HardwareProfile, calibration: Dataset, out_path: Path,
             keep_float: tuple[str, ...] = (), scheme: Int8Scheme | None = None) -> QuantizationInfo:
    """Static INT8 QDQ of a :func:`prepare`d model in the profile's scheme (or ``scheme``, one that computes the same
    outputs on every CPU the profile admits: u8u8 where the profile chose 7-bit weights); ``keep_float`` nodes stay
    float."""
    q = profile.quantization
    if q.method != "static":
        raise InputError(f"profile {profile.name}: int8 needs quantization.method 'static'")
    try:
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    except ImportError as exc:
        raise ToolchainError("onnxruntime.quantization is not importable; install edgefleet[compiler]") from exc
    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[q.calibration_method]
    chosen, why = profile.int8_scheme()
    if scheme is None or scheme == chosen:
        scheme = chosen
    elif scheme == FULL_WEIGHTS_EXACT and chosen == "u8s8_reduced":
        why = (f"8-bit weights as uint8 (u8u8) instead of the profile's {chosen}: uint8 x uint8 kernels cannot "
               "saturate (onnxruntime's AVX2 u8s8 ones can, hence 7 bits), so the engine computes the same on every "
               "x86 CPU the profile admits; slower than u8s8 on AVX2")
    else:
        raise InputError(f"profile {profile.name}: int8 scheme {scheme} cannot replace {chosen} ({why})")
    weight_type = QuantType.QUInt8 if scheme == "u8u8" else QuantType.QInt8
    activation_type = QuantType.QInt8 if scheme == "s8s8" else QuantType.QUInt8
    calib = calibration.head(q.max_calibration_samples)
    fixed = fixed_input_batch(prepared)
    def run(extra: dict[str, object]) -> None:  # the quantizer prints progress to stdout: keep it clean for --json
        with contextlib.redirect_stdout(sys.stderr):
            quantize_static(
                str(prepared), str(out_path), _Reader(calib, fixed=fixed),
                quant_format=QuantFormat.QDQ, per_channel=q.per_channel,
                activation_type=activation_type, weight_type=weight_type,
                reduce_range=scheme == "u8s8_reduced",
                calibrate_method=method, nodes_to_exclude=list(keep_float),
                extra_options={"CalibTensorRangeSymmetric": False, **extra},
            )

    retried = ""
    try:
        run({})
    except Exception as first:  # onnxruntime raises assorted types
        # the quantizer's weight adjustment for int32 biases crashes on some real graphs ("The truth value of an
        # array with more than one element is ambiguous"); without it the same graph quantizes
        try:
            run({"QDQDisableWeightAdjustForInt32Bias": True})
        except Exception:
            first_line = " ".join(str(first).split())[:240] or type(first).__name__
            raise ToolchainError(f"onnxruntime static quantization failed ({type(first).__name__}: {first_line}), "
                                 "also with QDQDisableWeightAdjustForInt32Bias") from first
        retried = (f"; quantized with QDQDisableWeightAdjustForInt32Bias (the default failed: "
                   f"{' '.join(str(first).split())[:120] or type(first).__name__})")
        note("int8 quantizer", "retried with QDQDisableWeightAdjustForInt32Bias",
             f"the default quantization failed: {type(first).__name__}: {' '.join(str(first).split())[:300]}")
    return QuantizationInfo(
        scheme=scheme, activation_type="int8" if scheme == "s8s8" else "uint8",
        weight_type="uint8" if scheme == "u8u8" else "int8",
        weight_bits=7 if scheme == "u8s8_reduced" else 8, per_channel=q.per_channel,
        calibration_method=q.calibration_method, calibration_samples=len(calib), reason=why + retried,
        float_nodes=keep_float)


def optimize_offline(source: Path, out_path: Path) -> Path:
    """onnxruntime's graph optimizations done once at build time, at the *basic* level only: constant
    folding and redundant-node removal are portable; the extended and layout levels fuse for the
    build host's CPU and onnxruntime's docs warn such a saved model may not run elsewhere."""
    import onnxruntime as ort

    so = session_options(ort, 1)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(out_path)
    try:
        ort.InferenceSession(str(source), so, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ToolchainError(f"onnxruntime cannot load {source.name}: {exc}") from exc
    if not out_path.is_file():
        shutil.copyfile(source, out_path)
    return out_path
