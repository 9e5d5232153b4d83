"""compile-pipeline: two models and the steps between them, built, gated and bundled as one (manifest version 7).

``edgefleet compile-pipeline PIPELINE.yaml --profile P --eval DATA -o OUT.bundle``:

1. ``pipeline.yaml`` (:class:`~edgefleet.protocol.pipeline.PipelineFile`) is read and its reader's charset resolved
   (``read.charset_from``, see :func:`resolve_charset`); the manifest holds the list itself.
2. The FP32 pipeline (both source models run by onnxruntime on this CPU, the steps of
   :class:`~edgefleet.judge.pipeline.Chain`) runs once over the evaluation images (and the calibration images):
   its end answers are the reference, and its crops are the reader's own evaluation and calibration data.
3. Each stage is compiled by the single-model compiler (:func:`compiler.compile.compile_model`: its precision
   chosen, quantized, gated on its own task -- ``segmentation`` for a probability-map detector at the map's
   threshold, ``detection`` for a YOLO head, ``ctc`` or ``classification`` for the reader -- benchmarked): the
   detector on the evaluation images, the reader on the FP32 pipeline's crops of them.
4. The pipeline with the stages as built runs over the evaluation images and its end answers are judged against
   the FP32 pipeline's (:func:`~edgefleet.judge.pipeline.judge_pipeline`: boxes matched at IoU 0.5, strings exact
   and by CER; by default at most 2% of the end answers may change).
5. One bundle: each stage's files under its stage name (``det-model.onnx``, ``det-selftest.npz``, ...), each
   stage's manifest (its files renamed so), the pipeline's own self-test sample ``selftest.npz`` (the images as
   ``input:<detector input>``, the end answers as ``expected:<end output>`` and the FP32 pipeline's as
   ``reference:<end output>``) and the top-level manifest describing the whole (see protocol/manifest.py).

Signing is not done here, as for ``edgefleet compile``: ``edgefleet fleet upload --sign-key`` (or the fleet) signs
the bundle into the TUF repository when it is uploaded.

**ARM64.** The OCR pipeline (PP-OCRv4 detector + recognizer from rapidocr-onnxruntime) does not convert to LiteRT
with the tflite toolchain (onnx2tf 1.29.24, TensorFlow 2.19): measured here, the detector fails at ``p2o.Add.278``
(dynamic H/W: 16 vs 24 channels after onnxsim), at ``p2o.ConvTranspose.0`` with its input fixed to 256x320 (the
batch left dynamic), at ``p2o.Conv.2`` with ``-b 1``, and without onnxsim it converts to a graph whose output is
fixed at 32x32 and which LiteRT cannot run at 256x320; the recognizer fails at ``p2o.Conv.35`` (width fixed to 320,
with or without onnxsim), ``p2o.Conv.2`` (``-b 1``) and ``p2o.MatMul.2`` (dynamic width, no onnxsim). Each is the
layout guessing onnx2tf documents as needing a per-model parameter-replacement file. ARM64 boxes therefore get it
as ONNX files run by onnxruntime: ``hw-profiles/arm64-cpu-onnx.yaml`` (the box adds ``edgefleet[onnxruntime]``;
int8 there uses 7-bit weights so an x86 build host's gate computes what ARM computes).

**Drift.** The top-level manifest carries the drift reference of the pipeline's end answers: the FP32 pipeline's on
the evaluation images (step 2's, the answers the end gate judges against; a single model's reference is its fp32
answers too), read as protocol/drift.py's task ``pipeline`` (:func:`~edgefleet.judge.pipeline.drift_reference`):
boxes per image (``count``), each string's length in characters (``text``) or top class (``classes``) and each
string's score. It is recorded as :func:`compiler.compile.with_drift` records a single model's; agents count their
live end answers into it (agent/core/drift.py) and the fleet scores them as any model's. Each stage's own manifest keeps
the reference its compile recorded (the detector's map as segmentation: foreground share; the reader's crops as
ctc: string length and score); agents do not count those (a stage's answers never leave the pipeline).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..engines import Engine, EngineSpec, load, load_bundle_engine
from ..engines.onnxruntime import CPU
from ..judge.data import load_dataset
from ..judge.pipeline import Chain, drift_reference, end_specs, judge_pipeline
from ..protocol.bundle import extract_bundle, sha256_file, write_bundle
from ..protocol.errors import ContractError
from ..protocol.manifest import (
    PIPELINE_VERSION,
    AccuracyReport,
    EngineVariant,
    FileEntry,
    Manifest,
    PipelineManifest,
    PrecisionCandidate,
    PrecisionChoice,
    SelfTestSummary,
    TaskReport,
)
from ..protocol.pipeline import PipelineFile, PipelineSpec, StageSource, load_pipeline_file
from ..protocol.preprocess import Preprocessing, load_preprocessing
from ..protocol.profile import load_profile
from .compile import (
    REFERENCE_RUNTIME,
    CompileOptions,
    Progress,
    compile_model,
    compiler_errors,
    with_drift,
)
from .errors import AccuracyGateFailed, CompilerError, InputError
from .graph import GraphInfo, check_model

__all__ = ["PipelineOptions", "PipelineResult", "compile_pipeline", "resolve_charset"]

SELFTEST_MAX_IMAGES = 8
SELFTEST_MAX_BYTES = 1 << 20  # as a single model's sample: halved until the file is at most this
_STEPS = 18  # progress: 1 load, 2 fp32 pipeline, 3-9 the detector's compile, 10-16 the reader's, 17 gate, 18 write
_ORDER = ("int8", "fp16", "bf16", "fp32")  # lowest first: the pipeline's precision is its lowest stage's


@dataclass(frozen=True)
class PipelineOptions:
    pipeline: Path  # pipeline.yaml
    profile: str
    eval: Path  # the detector input's images: .npz / .npy in its layout, or a folder of images (--preprocess)
    out: Path  # the bundle file
    calibration: Path | None = None  # the images int8 calibrates on (default: the evaluation images)
    preprocess: Path | None = None  # how an image becomes the detector's input (recorded for /infer/image)
    version: str | None = None  # default: pipeline.yaml's
    benchmark: bool = True
    fallback: bool = True  # a stage's int8 over budget keeps its most sensitive layers in float (compile's)
    cache_dir: Path | None = None  # each stage's compile reuses an identical earlier build
    min_answers: float = 0.98  # the end-answer gate: share of FP32's end answers kept
    max_cer: float = 0.02


@dataclass(frozen=True)
class StageBuild:
    """One stage as compiled: its manifest (files not yet renamed) and where its files are."""

    source: StageSource
    manifest: Manifest
    folder: Path
    seconds: float = 0.0


@dataclass(frozen=True)
class PipelineResult:
    bundle: Path
    manifest: Manifest
    notes: tuple[str, ...] = ()  # what the compile decided and why (the progress lines that matter)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    gate: tuple[dict[str, Any], ...] = ()  # each combination of stage precisions judged end to end, in order


def _noop(step: int, total: int, what: str) -> None:
    pass


# -- the charset ---------------------------------------------------------------------------------------------
def resolve_charset(spec: PipelineSpec, reader: Path, reader_info: GraphInfo, base: Path) -> PipelineSpec:
    """The spec with ``read.charset`` filled from ``read.charset_from`` (and ``charset_from`` cleared).

    ``model:KEY``: the reader's ONNX metadata entry KEY; ``file:PATH``: a UTF-8 file (relative to the YAML's
    folder). Either holds one character (or token) per line, split on ``\\n`` only (a charset may hold U+2028 and
    other characters Python's splitlines would split on), a final empty line dropped. The class count C of the
    reader's output decides the rest, as PaddleOCR lays its classes out: C == lines + 1 is the blank and the lines;
    C == lines + 2 is the blank, the lines and a space (PaddleOCR's ``use_space_char``, which its exported
    metadata leaves out: PP-OCRv4's recognizer has 6,623 lines and 6,625 classes), so ' ' is appended. Any other
    count is refused: a charset that does not fit the classes decodes wrong strings silently. An output whose class
    count is not fixed in the graph is taken as the lines say."""
    read = spec.read
    if read.op != "ctc" or read.charset_from is None:
        return spec
    src = read.charset_from
    if src.startswith("model:"):
        import onnx

        key = src[len("model:"):]
        meta = {p.key: p.value for p in onnx.load(str(reader), load_external_data=False).metadata_props}
        if key not in meta:
            raise InputError(f"read.charset_from {src!r}: the reader {reader.name} has no metadata entry {key!r} "
                             f"(it has {sorted(meta) or 'none'})")
        text = meta[key]
    else:
        path = Path(src[len("file:"):])
        path = path if path.is_absolute() else base / path
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"read.charset_from {src!r}: cannot read {path}: {exc}") from exc
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in lines]
    if not lines:
        raise InputError(f"read.charset_from {src!r} holds no characters")
    out = next((o for o in reader_info.outputs if o.name == read.output), reader_info.outputs[0])
    classes = out.shape[-1] if out.shape else -1
    if classes == len(lines) + 2:
        lines.append(" ")
    elif classes not in (-1, len(lines) + 1):
        raise InputError(f"read.charset_from {src!r} has {len(lines)} entries, and the reader's output {out.name!r} "
                         f"has {classes} classes: a CTC reader has the blank and its characters ({len(lines) + 1}), "
                         f"or those and a space ({len(lines) + 2}); give the charset that fits its classes")
    try:
        new_read = read.model_copy(update={"charset": tuple(lines), "charset_from": None})
        return PipelineSpec.model_validate({**spec.model_dump(), "read": new_read.model_dump()})
    except ValueError as exc:
        raise InputError(f"read.charset_from {src!r}: {exc}") from exc


# -- running the chain ---------------------------------------------------------------------------------------
Stage = Callable[[np.ndarray], Sequence[np.ndarray]]


def _stage_runner(engine: Engine, input_name: str) -> Stage:
    return lambda batch: engine.infer({input_name: batch})


def run_chain(chain: Chain, images: np.ndarray, detect: Stage, read: Stage,
              read_batch: int = 32) -> tuple[list[np.ndarray], np.ndarray]:
    """The chain over any number of images (as many per call as one request may hold): the end outputs, and every
    crop the reader was fed [M, c, h, w], in order."""
    ends: list[list[np.ndarray]] = []
    crops_all: list[np.ndarray] = []
    step = chain.max_images
    for s in range(0, len(images), step):
        x = np.ascontiguousarray(images[s: s + step])
        found = chain.boxes(detect(x))
        crops, owners = chain.crops(x, found)
        crops_all.append(crops)
        parts = [list(read(crops[i: i + read_batch])) for i in range(0, len(crops), read_batch)]
        reader_out = [np.concatenate([p[j] for p in parts]) for j in range(len(parts[0]))] if parts else []
        ends.append(chain.answers(found, owners, reader_out))
    return [np.concatenate([e[j] for e in ends]) for j in range(len(ends[0]))], np.concatenate(crops_all)


# -- the compile -------------------------------------------------------------------------------------------------
def compile_pipeline(opts: PipelineOptions, progress: Progress = _noop) -> PipelineResult:
    """Build, gate and bundle a pipeline; engine and judge errors are translated as compile_model translates them."""
    with compiler_errors():
        return _compile(opts, progress)


@dataclass
class _Work:
    opts: PipelineOptions
    progress: Progress
    file: PipelineFile
    spec: PipelineSpec  # charset resolved
    det: StageSource
    rec: StageSource
    det_path: Path
    rec_path: Path
    det_info: GraphInfo
    rec_info: GraphInfo
    prep: Preprocessing | None
    version: str
    notes: list[str] = field(default_factory=list)

    def say(self, step: int, what: str, note: bool = False) -> None:
        """A progress step; ``note``: a finding the compile keeps (shown as a note, returned in ``notes``)."""
        self.progress(step, _STEPS, f"note: {what}" if note else what)
        if note:
            self.notes.append(what)


def _load(opts: PipelineOptions, progress: Progress) -> _Work:
    progress(1, _STEPS, f"loading {opts.pipeline} and profile {opts.profile}")
    try:
        pf = load_pipeline_file(opts.pipeline)
    except ContractError as exc:
        raise InputError(str(exc)) from exc
    load_profile(opts.profile)  # a bad profile fails before any work
    for flag, path in (("--eval", opts.eval), ("--calibration", opts.calibration), ("--preprocess", opts.preprocess)):
        if path is not None and not path.exists():
            raise InputError(f"{path}: {flag} file not found")
    if opts.out.exists() and opts.out.is_dir():
        raise InputError(f"-o {opts.out}: a folder; give the bundle's file name (e.g. {opts.out / pf.name}.bundle)")
    if not 0.0 < opts.min_answers <= 1.0 or not 0.0 <= opts.max_cer <= 1.0:
        raise InputError(f"--min-answers {opts.min_answers} / --max-cer {opts.max_cer}: fractions in (0, 1]")
    base = opts.pipeline.parent
    det, rec = pf.stage(pf.pipeline.detector), pf.stage(pf.pipeline.reader)
    det_path, rec_path = pf.model_path(det, base), pf.model_path(rec, base)
    for st, p in ((det, det_path), (rec, rec_path)):
        if not p.is_file():
            raise InputError(f"{opts.pipeline}: stage {st.name!r}: model {p} not found")
    det_info, rec_info = check_model(det_path), check_model(rec_path)
    if len(det_info.inputs) != 1 or len(rec_info.inputs) != 1:
        raise InputError(f"a detect_then_read pipeline's stages take one image input each; {det.name} takes "
                         f"{len(det_info.inputs)}, {rec.name} {len(rec_info.inputs)}")
    for st, info, name in ((det, det_info, pf.pipeline.boxes.output), (rec, rec_info, pf.pipeline.read.output)):
        if name is not None and name not in [o.name for o in info.outputs]:
            raise InputError(f"{opts.pipeline}: stage {st.name!r} has no output {name!r} (its outputs: "
                             f"{[o.name for o in info.outputs]})")
    spec = resolve_charset(pf.pipeline, rec_path, rec_info, base)
    prep = load_preprocessing(opts.preprocess) if opts.preprocess is not None else None
    if prep is not None:
        _check_prep(prep, spec, det_info)
    return _Work(opts, progress, pf, spec, det, rec, det_path, rec_path, det_info, rec_info, prep,
                 opts.version or pf.version)


def _check_prep(prep: Preprocessing, spec: PipelineSpec, det_info: GraphInfo) -> None:
    """The crop step undoes the input's normalization (``crop.source``): it must be the preprocessing's."""
    src = spec.crop.source
    c = prep.channels
    same = (abs(src.scale - prep.scale) < 1e-9
            and np.allclose(np.broadcast_to(src.mean, c), np.broadcast_to(prep.mean, c))
            and np.allclose(np.broadcast_to(src.std, c), np.broadcast_to(prep.std, c)))
    if not same:
        raise InputError(f"--preprocess normalizes with scale {prep.scale:g}, mean {list(prep.mean)}, std "
                         f"{list(prep.std)}, and the pipeline's crop.source says scale {src.scale:g}, mean "
                         f"{list(src.mean)}, std {list(src.std)}: crops would be cut from wrongly restored pixels; "
                         "make them the same")
    if prep.layout != "nchw" or prep.input != det_info.inputs[0].name:
        raise InputError(f"--preprocess must feed the detector's input {det_info.inputs[0].name!r} in nchw layout "
                         f"(it feeds {prep.input!r}, {prep.layout})")


def _images(w: _Work, path: Path, what: str) -> np.ndarray:
    spec = w.det_info.inputs[0]
    data = load_dataset(path, w.det_info.inputs, need_labels=False, what=what, preprocessing=w.prep)
    x = np.ascontiguousarray(data.inputs[spec.name], dtype=np.float32)
    if x.ndim != 4:
        raise InputError(f"{path}: the detector's input is NCHW images; the {what} holds {list(x.shape)}")
    if len(x) == 0:
        raise InputError(f"{path}: the {what} holds no images")
    return x


def _compile(opts: PipelineOptions, progress: Progress) -> PipelineResult:
    # absolute paths: a build tool run in its own working folder (onnx2tf, LiteRT) gets paths under the work folder
    opts = dataclasses.replace(opts, out=opts.out.absolute())
    w = _load(opts, progress)
    det_in, rec_in = w.det_info.inputs[0].name, w.rec_info.inputs[0].name
    eval_x = _images(w, opts.eval, "evaluation set")
    calib_x = eval_x if opts.calibration is None else _images(w, opts.calibration, "calibration set")
    profile = load_profile(opts.profile)
    threads = profile.runtime.intra_op_threads
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edgefleet-pipeline-", dir=opts.out.parent) as tmp, \
            contextlib.ExitStack() as opened:
        work = Path(tmp)

        def open_engine(kind: str, path: Path, spec: EngineSpec, providers: tuple[str, ...] | None) -> Engine:
            engine = load(kind, path, spec, threads, providers)
            opened.callback(engine.close)
            return engine

        w.say(2, "running the fp32 pipeline (both source models, onnxruntime on this CPU)")
        ref_det = open_engine(REFERENCE_RUNTIME, w.det_path, EngineSpec(
            w.det_info.inputs, w.det_info.outputs, "fp32", profile.name, f"the fp32 {w.det.name}"), (CPU,))
        ref_rec = open_engine(REFERENCE_RUNTIME, w.rec_path, EngineSpec(
            w.rec_info.inputs, w.rec_info.outputs, "fp32", profile.name, f"the fp32 {w.rec.name}"), (CPU,))
        chain = Chain(w.spec, (int(eval_x.shape[2]), int(eval_x.shape[3])), [o.name for o in w.det_info.outputs],
                      [o.name for o in w.rec_info.outputs])
        ref_ends, eval_crops = run_chain(chain, eval_x, _stage_runner(ref_det, det_in), _stage_runner(ref_rec, rec_in))
        calib_crops = eval_crops if calib_x is eval_x else run_chain(
            chain, calib_x, _stage_runner(ref_det, det_in), _stage_runner(ref_rec, rec_in))[1]
        found = int(ref_ends[2].sum())
        w.say(2, f"the fp32 pipeline found {found} boxes on {len(eval_x)} evaluation images", note=True)
        if len(eval_crops) == 0 or len(calib_crops) == 0:
            which = "calibration" if len(eval_crops) else "evaluation"
            raise InputError(f"the fp32 pipeline found no boxes on the {which} images: the reader has nothing to be "
                             "compiled on; give images where the detector "
                             "finds what the pipeline reads")

        data = work / "data"
        data.mkdir()
        for fname, key, arr in (("det-eval.npz", det_in, eval_x), ("det-calib.npz", det_in, calib_x),
                                ("rec-eval.npz", rec_in, eval_crops), ("rec-calib.npz", rec_in, calib_crops)):
            feed: dict[str, Any] = {key: arr}
            np.savez(data / fname, **feed)
        det_task, det_args = _detector_task(w)
        rec_task, rec_args = _reader_task(w)
        det = _compile_stage(w, w.det, w.det_path, data / "det-calib.npz", data / "det-eval.npz", det_task, det_args,
                             opts.preprocess, work / "stage-det", 2)
        rec = _compile_stage(w, w.rec, w.rec_path, data / "rec-calib.npz", data / "rec-eval.npz", rec_task, rec_args,
                             None, work / "stage-rec", 9)

        w.say(17, "gating the end answers against the fp32 pipeline")
        gate = _EndGate(w, chain, eval_x, ref_ends, {det.source.name: _stage_runner(ref_det, det_in),
                                                     rec.source.name: _stage_runner(ref_rec, rec_in)},
                        threads, opened)
        stages = gate.settle({det.source.name: det, rec.source.name: rec},
                             {det.source.name: (w.det, w.det_path, data / "det-calib.npz", data / "det-eval.npz",
                                                det_task, det_args, opts.preprocess, 2),
                              rec.source.name: (w.rec, w.rec_path, data / "rec-calib.npz", data / "rec-eval.npz",
                                                rec_task, rec_args, None, 9)}, work)
        det, rec = stages[w.det.name], stages[w.rec.name]

        w.say(18, f"writing {opts.out}")
        bundle_dir = work / "bundle"
        bundle_dir.mkdir()
        stage_manifests = [_place_stage(s, bundle_dir) for s in (det, rec)]
        assert gate.report is not None
        manifest = _manifest(w, stage_manifests, gate, len(eval_x), stages, chain, eval_x, ref_ends, bundle_dir)
        write_bundle(manifest, bundle_dir, opts.out)
    return PipelineResult(bundle=opts.out, manifest=manifest, notes=tuple(w.notes),
                          stage_seconds={s.source.name: s.seconds for s in (det, rec)},
                          gate=tuple(t.as_json() for t in gate.tried))


def _detector_task(w: _Work) -> tuple[str, str | None]:
    if w.det.task:
        return w.det.task, w.det.task_args
    b = w.spec.boxes
    if b.format == "map":  # the map is judged at the threshold its regions are cut at
        return "segmentation", f"threshold={b.threshold:g}"
    return "detection", f"format={b.format},score={b.threshold:g},iou={b.nms_iou:g}"


def _reader_task(w: _Work) -> tuple[str, str | None]:
    if w.rec.task:
        return w.rec.task, w.rec.task_args
    if w.spec.read.op == "ctc":
        return "ctc", f"blank={w.spec.read.blank}"
    return "classification", None


def _compile_stage(w: _Work, st: StageSource, model: Path, calib: Path, eval_: Path, task: str, task_args: str | None,
                   preprocess: Path | None, out: Path, offset: int, precision: str | None = None) -> StageBuild:
    import time

    label = f"[{st.name}] "
    precision = precision or st.precision
    w.say(offset + 1, f"{label}compiling {model.name} ({precision}, gated as {task})")
    opts = CompileOptions(model=model, profile=w.opts.profile, calibration=calib, eval=eval_, out_dir=out,
                          name=st.name, version=w.version, precision=precision, benchmark=w.opts.benchmark,
                          cache_dir=w.opts.cache_dir, preprocess=preprocess, fallback=w.opts.fallback, task=task,
                          task_args=task_args)
    t0 = time.monotonic()
    try:
        result = compile_model(opts, lambda step, total, what: w.progress(offset + step, _STEPS, label + what))
    except CompilerError as exc:
        raise type(exc)(f"stage {st.name!r}: {exc}") from exc
    folder = out / "files"
    manifest = _one_precision(extract_bundle(result.bundle, folder))
    choice = manifest.precision_choice.reason if manifest.precision_choice is not None else manifest.precision
    w.say(offset + 7, f"{label}{choice}", note=True)
    return StageBuild(st, manifest, folder, round(time.monotonic() - t0, 2))


def _combo(stages: dict[str, StageBuild]) -> str:
    return " and ".join(f"{name} {s.manifest.precision}" for name, s in stages.items())


def _kept(report: TaskReport) -> str:
    """'41 of 48 fp32 answers kept: FAILS end answer agreement 0.8542 < 0.98' (the short form)."""
    d = report.details
    failed = [f"{c.name.replace('_', ' ')} {c.value:.4f} {'<' if c.kind == 'min' else '>'} {c.bound:g}"
              for c in report.criteria if not c.passed]
    return (f"{int(d.get('same_answers', 0))} of {int(d.get('fp32_boxes', 0))} fp32 answers kept: "
            + (f"FAILS {', '.join(failed)}" if failed else "passes"))


def _task_line(report: TaskReport) -> str:
    from .compile import task_figures

    d = report.details
    return (f"{task_figures(report)} ({int(d.get('same_answers', 0))} of {int(d.get('fp32_boxes', 0))} fp32 answers "
            f"kept on {int(d.get('images', 0))} images)")


# -- the end-answer gate and its fallback ------------------------------------------------------------------------
@dataclass(frozen=True)
class Tried:
    """One combination of stage precisions judged end to end: ``built`` (the engines the compile built) or
    ``measured`` (a stage's FP32 source model standing in for its fp32 rebuild, to choose which stage falls back)."""

    precisions: dict[str, str]
    report: TaskReport
    how: str

    @property
    def label(self) -> str:
        return " and ".join(f"{k} {v}" for k, v in self.precisions.items())

    def as_json(self) -> dict[str, Any]:
        d = self.report.details
        return {"stages": dict(self.precisions), "how": self.how, "passed": self.report.passed,
                "kept": int(d.get("same_answers", 0)), "of": int(d.get("fp32_boxes", 0)),
                "criteria": {c.name: round(c.value, 6) for c in self.report.criteria}}


_HOW = {"built": "as built", "measured": "measured with a stage's FP32 source model in place of its fp32 build"}
StageArgs = tuple[StageSource, Path, Path, Path, str, "str | None", "Path | None", int]


class _EndGate:
    """The pipeline's end answers against the FP32 pipeline's, with each stage's own precision choice; when they
    change beyond the gate, the stages fall back to fp32 one at a time (only those whose precision is ``auto``):
    each single-stage fallback is measured first (that stage's FP32 source model in its place), the one that
    passes and keeps the faster quantized stage is rebuilt at fp32 and judged again as built; when none passes
    alone, every auto stage falls back. Explicit precisions are never changed: the compile fails (exit 3) saying
    which combination would pass."""

    def __init__(self, w: _Work, chain: Chain, images: np.ndarray, ref_ends: list[np.ndarray],
                 fp32: dict[str, Stage], threads: int, opened: contextlib.ExitStack):
        self.w, self.chain, self.images, self.ref_ends, self.fp32 = w, chain, images, ref_ends, fp32
        self.threads, self.opened = threads, opened
        self.tried: list[Tried] = []
        self.report: TaskReport | None = None
        self.runners: dict[str, Stage] = {}
        self.fell_back: dict[str, str] = {}  # stage -> why it is fp32 now

    def _judge(self, runners: dict[str, Stage], precisions: dict[str, str], how: str) -> Tried:
        spec = self.w.spec
        ends = run_chain(self.chain, self.images, runners[spec.detector], runners[spec.reader])[0]
        t = Tried(dict(precisions), judge_pipeline(spec, self.ref_ends, ends, min_answers=self.w.opts.min_answers,
                                                   max_cer=self.w.opts.max_cer), how)
        self.tried.append(t)
        return t

    def _built(self, stages: dict[str, StageBuild]) -> dict[str, Stage]:
        out = {}
        for name, s in stages.items():
            engine = load_bundle_engine(s.manifest, s.folder / s.manifest.engine, self.threads)
            self.opened.callback(engine.close)
            out[name] = _stage_runner(engine, s.manifest.inputs[0].name)
        return out

    def settle(self, stages: dict[str, StageBuild], args: dict[str, StageArgs], work: Path) -> dict[str, StageBuild]:
        w = self.w
        runners = self._built(stages)
        first = self._judge(runners, {n: s.manifest.precision for n, s in stages.items()}, "built")
        if first.report.passed:
            w.say(17, f"end answers with {first.label}: {_task_line(first.report)}", note=True)
            self.report, self.runners = first.report, runners
            return stages
        w.say(17, f"end answers with {first.label} change beyond the gate: {_task_line(first.report)}", note=True)
        quantized = [n for n, s in stages.items() if s.manifest.precision != "fp32"]
        if not quantized:  # fp32 everywhere and still different: the built engines compute other answers
            raise AccuracyGateFailed(f"the pipeline built at fp32 answers differently from its FP32 source models: "
                                     f"{_task_line(first.report)}")
        # each stage alone back at fp32, measured with its source model
        alone = {n: self._judge({**runners, n: self.fp32[n]}, {**first.precisions, n: "fp32"}, "measured")
                 for n in quantized}
        auto = [n for n in quantized if stages[n].source.precision == "auto"]
        passing = [n for n in auto if alone[n].report.passed]
        if passing:  # keep quantized the stage that gains most from it (its own benchmark), else the better answers
            back = [min(passing, key=lambda n: (-_stage_speedup(stages, quantized, n),
                                                -alone[n].report.value))]
        elif auto and len(quantized) > 1 and set(auto) == set(quantized):
            back = list(auto)
        else:
            raise AccuracyGateFailed(self._refusal(first, alone, stages))
        for n in back:
            why = f"the pipeline's end answers with {first.label} changed beyond its gate ({_kept(first.report)})"
            if n in alone:
                why += f"; with {n} fp32 instead: {_kept(alone[n].report)}"
            w.say(17, f"{n} falls back to fp32: {why}", note=True)
            self.fell_back[n] = why
            src, model, calib, eval_, task, task_args, prep, offset = args[n]
            rebuilt = _compile_stage(w, src, model, calib, eval_, task, task_args, prep, work / f"stage-{n}-fp32",
                                     offset, precision="fp32")
            stages = {**stages, n: _fallen_back(rebuilt, stages[n], why)}
        runners = self._built(stages)
        final = self._judge(runners, {n: s.manifest.precision for n, s in stages.items()}, "built")
        if not final.report.passed:
            raise AccuracyGateFailed(self._refusal(final, {}, stages))
        w.say(17, f"end answers with {final.label}: {_task_line(final.report)}", note=True)
        self.report, self.runners = final.report, runners
        return stages

    def _refusal(self, first: Tried, alone: dict[str, Tried], stages: dict[str, StageBuild]) -> str:
        msg = f"the pipeline's end answers changed beyond its gate with {first.label}: {_kept(first.report)}"
        hints = [f"with {t.label} (measured): {_kept(t.report)}" for t in alone.values()]
        would = [n for n, t in alone.items() if t.report.passed]
        tail = (f"; set precision: auto (or fp32) for stage {' or '.join(repr(n) for n in would)} in pipeline.yaml "
                "(an explicit precision is never changed by the pipeline's gate)" if would else
                "; no stage alone at fp32 passes: set the stages' precision to fp32 (or auto), give calibration "
                "images like the devices' (--calibration), or loosen --min-answers / --max-cer")
        return msg + ("; " + "; ".join(hints) if hints else "") + tail


def _one_precision(m: Manifest) -> Manifest:
    """A stage ships one precision: the one the pipeline's end answers are gated with. Where the build host cannot
    time the profile's CPUs, compile_model ships every passing precision for the device to time (variants); a
    stage of a pipeline keeps only its own engine (the profile's default first), and says so."""
    if not m.variants:
        return m
    left = [v.precision for v in m.variants]
    old = m.precision_choice
    assert old is not None
    choice = PrecisionChoice(
        mode="auto", chosen=m.precision, candidates=old.candidates,
        reason=f"{m.precision}: a pipeline's stage ships one precision, the one its end answers are gated with (the "
               f"profile's default first); {', '.join(left)} also passed this stage's gate but "
               f"{'is' if len(left) == 1 else 'are'} not shipped, as "
               f"the devices cannot choose among them without an end-to-end gate of each combination; {old.reason}")
    dropped = {f for v in m.variants for f in (v.engine, v.selftest)}
    return m.model_copy(update={"variants": (), "precision_choice": choice,
                                "files": {k: v for k, v in m.files.items() if k not in dropped}})


def _stage_speedup(stages: dict[str, StageBuild], quantized: list[str], back: str) -> float:
    """How much faster than fp32 the stages kept quantized are when ``back`` falls back (their benchmarks'
    geometric mean; 1.0 when not benchmarked)."""
    from .compile.choose import geomean

    gain = 1.0
    for n in quantized:
        if n == back:
            continue
        b = stages[n].manifest.benchmark
        if b is not None and b.candidate_precision == stages[n].manifest.precision:
            gain *= geomean(b.points)
    return gain


def _fallen_back(rebuilt: StageBuild, was: StageBuild, why: str) -> StageBuild:
    """The fp32 rebuild of a stage, its precision choice saying why: the stage's own choice (its candidates and
    their gate figures, kept) and the pipeline's gate that overruled it."""
    old, new = was.manifest.precision_choice, rebuilt.manifest
    if old is None:
        return rebuilt
    choice = PrecisionChoice(mode=old.mode, chosen="fp32", reason=f"fp32: {why}; this stage alone chose {old.reason}",
                             candidates=old.candidates)
    return StageBuild(rebuilt.source, new.model_copy(update={"precision_choice": choice}), rebuilt.folder,
                      round(was.seconds + rebuilt.seconds, 2))


# -- the bundle ------------------------------------------------------------------------------------------------
def _place_stage(s: StageBuild, bundle_dir: Path) -> Manifest:
    """The stage's files copied into the bundle's folder under ``<stage>-<name>``; its manifest renamed to match."""
    prefix = f"{s.source.name}-"
    for name in s.manifest.files:
        (s.folder / name).rename(bundle_dir / (prefix + name))
    m = s.manifest
    variants = tuple(EngineVariant.model_validate({**v.model_dump(), "engine": prefix + v.engine,
                                                   "selftest": prefix + v.selftest}) for v in m.variants)
    return Manifest.model_validate({
        **m.model_dump(), "engine": prefix + m.engine, "selftest": prefix + m.selftest,
        "files": {prefix + k: v.model_dump() for k, v in m.files.items()},
        "variants": [v.model_dump() for v in variants]})


def _accuracy(report: TaskReport, n: int, precision: str) -> AccuracyReport:
    """The end-answer gate as an AccuracyReport: the criterion with the least room decides, each as 'higher is
    better' in [0, 1] (the single-model task gate's rule, judge.gate)."""

    def score(value: float, kind: str) -> float:
        return value if kind == "min" else round(1.0 - value, 6)

    deciding = min(report.criteria, key=lambda c: score(c.value, c.kind) - score(c.bound, c.kind))
    cand = score(deciding.value, deciding.kind)
    drop, max_drop = round(1.0 - cand, 6), round(1.0 - score(deciding.bound, deciding.kind), 6)
    return AccuracyReport(metric="agreement", eval_samples=n, reference_precision="fp32", reference=1.0,
                          candidate_precision=precision, candidate=1.0 - drop, drop=drop,  # type: ignore[arg-type]
                          max_drop=max_drop, passed=drop <= max_drop + 1e-9, task=report)


def _write_selftest(images: np.ndarray, run: Callable[[np.ndarray], list[np.ndarray]], ref_ends: list[np.ndarray],
                    input_name: str, names: Sequence[str], path: Path, limit: int) -> int:
    """The pipeline's self-test sample: up to ``limit`` evaluation images with the pipeline's end answers as built
    (``expected:``) and the FP32 pipeline's (``reference:``), halved until the file is at most SELFTEST_MAX_BYTES
    (one image is kept even if larger). The expected answers are computed on the sample as one request, as the
    agent runs it."""
    n = max(1, min(limit, len(images)))
    while True:
        x = np.ascontiguousarray(images[:n])
        expected = run(x)
        arrays: dict[str, Any] = {f"input:{input_name}": x}
        arrays.update({f"expected:{k}": v for k, v in zip(names, expected, strict=True)})
        arrays.update({f"reference:{k}": v[:n] for k, v in zip(names, ref_ends, strict=True)})
        np.savez_compressed(path, **arrays)
        if path.stat().st_size <= SELFTEST_MAX_BYTES or n == 1:
            return n
        n = max(1, n // 2)


def _manifest(w: _Work, stage_manifests: list[Manifest], gate: _EndGate, n_eval: int,
              stages: dict[str, StageBuild], chain: Chain, eval_x: np.ndarray, ref_ends: list[np.ndarray],
              bundle_dir: Path) -> Manifest:
    det_m = stage_manifests[0]
    report = gate.report
    assert report is not None
    spec = w.spec

    def run(x: np.ndarray) -> list[np.ndarray]:
        return run_chain(chain, x, gate.runners[spec.detector], gate.runners[spec.reader])[0]

    outs = end_specs(w.spec)
    precisions = {m.precision for m in stage_manifests}
    lowest = next(q for q in _ORDER if q in precisions)
    n_sample = _write_selftest(eval_x, run, ref_ends, det_m.inputs[0].name, [o.name for o in outs],
                               bundle_dir / "selftest.npz", min(SELFTEST_MAX_IMAGES, chain.max_images))
    files = {name: entry for m in stage_manifests for name, entry in m.files.items()}
    p = bundle_dir / "selftest.npz"
    files["selftest.npz"] = FileEntry(sha256=sha256_file(p), size_bytes=p.stat().st_size)
    acc = _accuracy(report, n_eval, lowest)
    auto = all(s.source.precision == "auto" for s in stages.values())
    own = "; ".join(f"{name}: {s.manifest.precision_choice.reason}" if s.manifest.precision_choice else
                    f"{name}: {s.manifest.precision}" for name, s in stages.items())
    how = ("; ".join(f"{n} fell back to fp32: {why}" for n, why in gate.fell_back.items()) if gate.fell_back
           else "each stage's own choice")
    candidates = []
    for t in gate.tried:  # every combination judged end to end, in order, the shipped one last
        a = _accuracy(t.report, n_eval, next(q for q in _ORDER if q in t.precisions.values()))
        candidates.append(PrecisionCandidate(
            precision=a.candidate_precision, top1=a.candidate, metric="agreement", drop=a.drop, passed=a.passed,
            note=f"{t.label} ({_HOW[t.how]}): {_task_line(t.report)}"))
    choice = PrecisionChoice(
        mode="auto" if auto else "fixed", chosen=lowest,  # type: ignore[arg-type]
        reason=f"{lowest}: {_combo(stages)} ({how}); end answers {_task_line(report)}; {own}",
        candidates=tuple(candidates))
    manifest = Manifest(
        manifest_version=PIPELINE_VERSION, name=w.file.name, version=w.version, profile=det_m.profile,
        backend=det_m.backend, precision=lowest,  # type: ignore[arg-type]
        created_at=dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        engine=det_m.engine, selftest="selftest.npz", inputs=det_m.inputs, outputs=outs, files=files,
        accuracy=acc, benchmark=None, toolchain={**det_m.toolchain, "pipeline": w.spec.kind},
        cpu_features=tuple(sorted({f for m in stage_manifests for f in m.cpu_features})),
        build_host=det_m.build_host, precision_choice=choice,
        selftest_summary=SelfTestSummary(samples=n_sample), engine_compatibility=det_m.engine_compatibility,
        preprocessing=det_m.preprocessing,
        pipeline=PipelineManifest(spec=w.spec, stages=tuple(stage_manifests)))
    return with_drift(manifest, lambda: drift_reference(spec, ref_ends), lambda why: w.say(18, why, note=True))
