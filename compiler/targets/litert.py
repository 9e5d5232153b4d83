"""LiteRT (TFLite) target for ARM64 CPUs: onnx2tf converts the ONNX model in the isolated "tflite" toolchain
environment (:mod:`compiler.toolchain`; it pins TensorFlow and old numpy/onnx), and the engine runs with
``ai_edge_litert`` in edgefleet's own environment.

INT8 is TFLite full-integer quantization (int8 weights per channel, int8 activations, min-max ranges from
*our* calibration set; onnx2tf is never left to download its MS-COCO samples) with float32 input and output,
so the bundle's FP32 input spec holds. Inputs keep the ONNX layout (NCHW): onnx2tf is told to keep it
(``--keep_ncw_or_nchw_or_ncdhw_input_names``; in onnx2tf 1.29 that is ``-k``, while ``-kat`` keeps a shape
"absolutely").

The engine file describes its own inputs and outputs: onnx2tf renames outputs (the float32 model keeps the
ONNX names, the quantized ones come out as ``output_0``, ``output_1``, ... in the ONNX output order) and
leaves 3-5D outputs channels-last, so the build writes a TFLite metadata entry ``edgefleet_io``: the
contract :class:`engines.litert.IOMap`, which the engine that serves (and gates) the model reads to feed and
return tensors in the ONNX names, order and layout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ...engines.errors import EngineError
from ...engines.litert import IO_METADATA, IOMap, Port, interpreter_class
from ...judge.data import Dataset
from ...protocol.manifest import QuantizationInfo, TensorSpec
from ...protocol.profile import HardwareProfile
from .. import toolchain
from ..errors import InputError, ToolchainError
from ..graph import GraphInfo

__all__ = ["LiteRTTarget"]

TOOLCHAIN = "tflite"
CONVERT_TIMEOUT_S = 1800.0  # onnx2tf: conversion plus one calibration pass per sample
TOOLCHAIN_MAX_IR = 11  # the toolchain's onnxruntime 1.23 loads ONNX IR versions up to 11
_NP_FEED = {"FP32": np.float32, "FP16": np.float32, "INT8": np.int8, "UINT8": np.uint8, "INT32": np.int32,
            "INT64": np.int64, "BOOL": np.bool_}

# What onnx2tf 1.29 writes into its output folder, ``<stem>`` being the ONNX file's name:
#   <stem>_float32.tflite                          float32 throughout                       -> our "fp32"
#   <stem>_float16.tflite                          float16 weights, float32 compute
#   <stem>_dynamic_range_quant.tflite              int8 weights, float activations (dynamic range)
#   <stem>_integer_quant.tflite                    int8 weights and activations, float32 in/out -> our "int8"
#   <stem>_full_integer_quant.tflite               the same with int8 input and output (-iqd/-oqd)
#   <stem>_integer_quant_with_int16_act.tflite     int16 activations, int8 weights, float32 in/out
#   <stem>_full_integer_quant_with_int16_act.tflite  the same with integer input and output
#   saved_model.pb, variables/                     the TensorFlow SavedModel the others are made from
_ENGINE_FILE = {"fp32": "{stem}_float32.tflite", "int8": "{stem}_integer_quant.tflite"}


class LiteRTTarget:
    qdq_int8_min_opset: int | None = None
    builds_with_reference_runtime = False
    float_build_needs_samples = False

    def __init__(self, keep_dir: Path | None = None):
        """``keep_dir``: an empty (or new) folder to convert in and keep afterwards, with onnx2tf's command,
        input, calibration files, output and log, for inspection; by default a temporary folder."""
        self.keep_dir = keep_dir

    def build(self, source: Path, info: GraphInfo, precision: str, profile: HardwareProfile,
              calibration: Dataset | None, out_path: Path) -> QuantizationInfo | None:
        if precision not in _ENGINE_FILE:
            raise InputError(f"the litert target builds {' or '.join(_ENGINE_FILE)}, not {precision}")
        for spec in info.inputs:
            if spec.batch_axis != 0:
                raise InputError(f"input {spec.name!r}: the litert target needs the batch on axis 0 of every input")
        calib = None
        if precision == "int8":
            if calibration is None:
                raise InputError("full-integer INT8 quantization needs a calibration set (--calibration)")
            bad = [s.name for s in info.inputs if s.datatype != "FP32"]
            if bad:
                raise InputError(f"TFLite full-integer quantization (onnx2tf) needs float32 inputs; {bad} are not: "
                                 "compile with --precision fp32")
            calib = calibration.head(profile.quantization.max_calibration_samples)
        py = toolchain.python(TOOLCHAIN)  # a one-line ToolchainError when it is not installed

        if self.keep_dir is not None:
            if self.keep_dir.exists() and any(self.keep_dir.iterdir()):
                raise InputError(f"{self.keep_dir}: the folder to keep onnx2tf's work in must be empty")
            self.keep_dir.mkdir(parents=True, exist_ok=True)
            _convert(py, source, info, precision, profile, calib, self.keep_dir, out_path)
        else:
            with tempfile.TemporaryDirectory(prefix="edgefleet-onnx2tf-", dir=out_path.parent) as tmp:
                _convert(py, source, info, precision, profile, calib, Path(tmp), out_path)
        if calib is None:
            return None
        q = profile.quantization
        asked = "" if q.calibration_method == "minmax" else (
            f"; the profile asks for {q.calibration_method} calibration, which the TFLite converter does not offer")
        return QuantizationInfo(
            scheme="s8s8", activation_type="int8", weight_type="int8", weight_bits=8, per_channel=q.per_channel,
            calibration_method="minmax", calibration_samples=len(calib),
            reason="LiteRT full-integer quantization (onnx2tf, TFLite converter): int8 weights "
                   f"{'per channel' if q.per_channel else 'per tensor'} and int8 activations with min-max ranges "
                   f"from {len(calib)} calibration samples; float32 input and output" + asked)

    def toolchain_versions(self) -> dict[str, str]:
        import importlib.metadata as md

        st = toolchain.status(TOOLCHAIN)
        out: dict[str, str] = {k: st.versions[k] for k in ("onnx2tf", "tensorflow") if k in st.versions}
        for dist in ("ai-edge-litert", "tflite-runtime"):
            try:
                out[dist] = md.version(dist)
                break
            except md.PackageNotFoundError:
                continue
        return out

    def engine_compatibility(self) -> dict[str, str]:
        return {}


# -- building ------------------------------------------------------------------------------------------
def _convert(py: Path, source: Path, info: GraphInfo, precision: str, profile: HardwareProfile,
             calib: Dataset | None, work: Path, out_path: Path) -> None:
    work, out_path = work.resolve(), out_path.resolve()  # onnx2tf runs in ``work``: a relative --out would miss
    model = _stage_source(source, work / "model.onnx")  # onnx2tf simplifies its input file in place
    out_dir = work / "onnx2tf"
    cmd = [str(py), "-m", "onnx2tf", "-i", str(model), "-o", str(out_dir)]
    keep = [_sanitize(s.name) for s in info.inputs if 3 <= len(s.shape) <= 5]
    if keep:
        cmd += ["--keep_ncw_or_nchw_or_ncdhw_input_names", *keep]
    if calib is not None:
        cmd += ["--output_integer_quantized_tflite",
                "--quant_type", "per-channel" if profile.quantization.per_channel else "per-tensor"]
        cmd += _write_calibration(calib, info, work / "calibration")
    (work / "onnx2tf-command.json").write_text(json.dumps(cmd, indent=1), encoding="utf-8")
    toolchain.run_tool(cmd, CONVERT_TIMEOUT_S, "onnx2tf", log=work / "onnx2tf.log", env=_tool_env(py), cwd=work)
    produced = out_dir / _ENGINE_FILE[precision].format(stem=model.stem)
    if not produced.is_file():  # onnx2tf reports some quantization failures as warnings and exits 0
        log = (work / "onnx2tf.log").read_text(encoding="utf-8", errors="replace")
        raise ToolchainError(f"onnx2tf wrote no {produced.name}: {toolchain.last_meaningful_line(log)}")
    engine = work / f"engine{out_path.suffix}"
    shutil.copyfile(produced, engine)
    io = _io_map(engine, info, source, calib)
    _embed_metadata(engine, IO_METADATA, json.dumps(io.to_json()).encode())
    shutil.move(engine, out_path)


def _write_calibration(calib: Dataset, info: GraphInfo, folder: Path) -> list[str]:
    """Our calibration set as onnx2tf's ``-cind NAME FILE.npy MEAN STD`` arguments, one per input.

    onnx2tf feeds each sample (batch 1) as ``(x - MEAN) / STD`` to the TFLite converter, in the layout of the
    converted model's input: with the inputs kept NCHW (``--keep_ncw_or_nchw_or_ncdhw_input_names``) that is
    the ONNX layout itself (an NHWC .npy is only for inputs onnx2tf turns channels-last). Our samples are
    already what the model takes, so MEAN 0 and STD 1 pass them through unchanged."""
    folder.mkdir(parents=True, exist_ok=True)
    args: list[str] = []
    for spec in info.inputs:
        path = folder / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', spec.name)}.npy"
        np.save(path, np.ascontiguousarray(calib.inputs[spec.name], dtype=np.float32))
        args += ["--custom_input_op_name_np_data_path", _sanitize(spec.name), str(path), "0.0", "1.0"]
    return args


def _tool_env(py: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{py.parent}{os.pathsep}{env.get('PATH', '')}"  # onnx2tf runs the env's `onnxsim` by name
    env["VIRTUAL_ENV"] = str(py.parent.parent)
    env["PYTHONNOUSERSITE"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = "-1"  # TensorFlow would probe for GPUs
    # onnx2tf downloads MS-COCO samples when it is given no calibration data (and for some shape checks):
    # a dead proxy on loopback makes any such download fail at once instead of fetching the internet's data
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env[var] = "http://127.0.0.1:9"
    for var in ("NO_PROXY", "no_proxy"):
        env.pop(var, None)
    return env


def _sanitize(name: str) -> str:
    """The name onnx2tf gives an ONNX tensor in TensorFlow (':' is not allowed, a leading '/' neither)."""
    return re.sub(r"^/", "wa/", name.replace(":", "__"))


def _stage_source(source: Path, dest: Path) -> Path:
    """A copy of the model for onnx2tf, external data inlined, in an IR version the toolchain's onnxruntime
    loads: a newer exporter stamps a newer IR version than the operator sets in the graph need."""
    import onnx
    import onnx.helper

    try:
        model = onnx.load(str(source))
    except Exception as exc:
        raise InputError(f"{source}: not a readable ONNX model ({exc})") from exc
    if model.ir_version > TOOLCHAIN_MAX_IR:
        opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=1)
        need = min((row[1] for row in onnx.helper.VERSION_TABLE if row[2] >= opset), default=model.ir_version)
        if need > TOOLCHAIN_MAX_IR:
            raise ToolchainError(f"{source.name} uses ONNX opset {opset} (IR {need}); the tflite toolchain's "
                                 f"onnxruntime reads IR <= {TOOLCHAIN_MAX_IR}: export with an older opset")
        model.ir_version = need
    onnx.save(model, str(dest))
    return dest


def _compatible(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x < 0 or y < 0 for x, y in zip(a, b, strict=True))


def _channels_last(rank: int) -> tuple[int, ...]:
    return (0, *range(2, rank), 1)  # NCHW -> NHWC


def _channels_first(rank: int) -> tuple[int, ...]:
    return (0, rank - 1, *range(1, rank - 1))  # NHWC -> NCHW


def _io_map(engine: Path, info: GraphInfo, source: Path, calib: Dataset | None) -> IOMap:
    """Which signature key and layout each ONNX input and output has in the engine.

    Outputs are matched by name: the ONNX name, onnx2tf's sanitized form of it, or ``output_<i>`` for the
    i-th ONNX output (the quantized files are made from the SavedModel, whose outputs onnx2tf lists in ONNX
    order). Layouts by shape: the ONNX shape, or its channels-last form; where both fit (square tensors),
    by comparing with onnxruntime on a few samples."""
    interp = _interpreter(engine, 1)
    sigs = interp.get_signature_list()
    if len(sigs) != 1:
        raise ToolchainError(f"onnx2tf made an engine with signatures {sorted(sigs)}; expected one")
    signature = next(iter(sigs))
    sig = interp.get_signature_runner(signature)
    in_d, out_d = sig.get_input_details(), sig.get_output_details()

    def pick(spec: TensorSpec, i: int, keys: dict[str, Any], what: str) -> str:
        for key in (spec.name, _sanitize(spec.name), f"output_{i}" if what == "output" else None):
            if key in keys:
                return key
        if len(keys) == 1 and len(info.inputs if what == "input" else info.outputs) == 1:
            return next(iter(keys))
        raise ToolchainError(f"cannot find ONNX {what} {spec.name!r} among the engine's {sorted(keys)}")

    inputs = []
    for i, spec in enumerate(info.inputs):
        key = pick(spec, i, in_d, "input")
        have, want = tuple(int(d) for d in in_d[key]["shape_signature"]), tuple(spec.shape)
        if _compatible(want, have):
            perm = None
        elif 3 <= len(want) <= 5 and _compatible(tuple(want[j] for j in _channels_last(len(want))), have):
            perm = _channels_last(len(want))
        else:
            raise ToolchainError(f"input {spec.name!r} has shape {list(have)} in the engine, {list(want)} in ONNX")
        inputs.append(Port(spec.name, key, perm))

    outputs: list[Port] = []
    ambiguous: list[int] = []
    for i, spec in enumerate(info.outputs):
        key = pick(spec, i, out_d, "output")
        have, want = tuple(int(d) for d in out_d[key]["shape_signature"]), tuple(spec.shape)
        fits = [p for p in ([None] + ([_channels_first(len(have))] if 3 <= len(have) <= 5 else []))
                if _compatible(want, tuple(have[j] for j in p) if p else have)]
        if not fits:
            raise ToolchainError(f"output {spec.name!r} has shape {list(have)} in the engine, {list(want)} in ONNX")
        if len(fits) > 1:
            ambiguous.append(i)
        outputs.append(Port(spec.name, key, fits[-1]))
    io = IOMap(signature, tuple(inputs), tuple(outputs))
    return _settle_layouts(engine, io, ambiguous, info, source, calib) if ambiguous else io


def _settle_layouts(engine: Path, io: IOMap, ambiguous: list[int], info: GraphInfo, source: Path,
                    calib: Dataset | None) -> IOMap:
    """For outputs whose shape fits both layouts, keep the one closer to onnxruntime's answer."""
    import onnxruntime as ort

    if calib is not None:
        feed = calib.take(0, 4)
    else:
        rng = np.random.default_rng(0)
        feed = {s.name: rng.random([2 if d < 0 else d for d in s.shape]).astype(_NP_FEED[s.datatype])
                for s in info.inputs}
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref = ort.InferenceSession(str(source), so, providers=["CPUExecutionProvider"]).run(
        [o.name for o in info.outputs], feed)
    raw = IOMap(io.signature, io.inputs, tuple(Port(p.name, p.key, None) for p in io.outputs))
    got = _run_with_map(engine, raw, feed)
    outs = list(io.outputs)
    for i in ambiguous:
        perm = _channels_first(got[i].ndim)
        err_keep = float(np.mean(np.abs(got[i] - ref[i]))) if got[i].shape == ref[i].shape else np.inf
        err_perm = float(np.mean(np.abs(got[i].transpose(perm) - ref[i])))
        outs[i] = Port(outs[i].name, outs[i].key, perm if err_perm < err_keep else None)
    return IOMap(io.signature, io.inputs, tuple(outs))


def _run_with_map(engine: Path, io: IOMap, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    interp = _interpreter(engine, 1)
    sig = interp.get_signature_runner(io.signature)
    res = sig(**{p.key: np.ascontiguousarray(feed[p.name].transpose(p.perm) if p.perm else feed[p.name])
                 for p in io.inputs})
    return [np.asarray(res[p.key]) for p in io.outputs]


# -- the engine file ---------------------------------------------------------------------------------
def _interpreter(engine: Path, threads: int) -> Any:
    try:
        interpreter, _ = interpreter_class()
    except EngineError as exc:
        raise ToolchainError(str(exc)) from exc
    try:
        interp = interpreter(model_path=str(engine), num_threads=threads)
        interp.allocate_tensors()
    except (ValueError, RuntimeError) as exc:
        raise ToolchainError(f"LiteRT cannot load {engine.name}: {exc}") from exc
    return interp


def _embed_metadata(engine: Path, name: str, data: bytes) -> None:
    """Add (or replace) a named metadata entry of a TFLite flatbuffer."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as fb

    model = fb.ModelT.InitFromPackedBuf(bytearray(engine.read_bytes()), 0)
    buf = fb.BufferT()
    buf.data = np.frombuffer(data, dtype=np.uint8)
    model.buffers = [*(model.buffers or []), buf]
    entry = fb.MetadataT()
    entry.name = name
    entry.buffer = len(model.buffers) - 1
    model.metadata = [m for m in (model.metadata or []) if m.name not in (name, name.encode())] + [entry]
    builder = flatbuffers.Builder(engine.stat().st_size + len(data) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    engine.write_bytes(bytes(builder.Output()))
