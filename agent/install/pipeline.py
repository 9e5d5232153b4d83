"""A pipeline bundle (manifest version 7) loaded and checked at install, before it serves as one model
(agent/core/pipeline.py serves it).

**Install** (:func:`prepare`; the installer calls it where a single model is loaded, self-tested and warmed up).
The bundle was verified as a whole when it was staged (every file's hash, the top-level manifest's checks and the
roles of its engine and self-test sample); here each stage's own files are checked for their roles too
(protocol.roles: an ONNX engine, an .npz sample with the stage's tensors). Each stage is loaded from its own
manifest, in its own precision, on the runtime the agent picks for a single model (agent.install.runtime_choice:
pinned by ``runtime:`` in the config, the only one installed, or timed here on the stage's own sample), ``instances``
engines of ``intra_op_threads`` each (the operator's layout; no layout trial per stage). Then, in turns with the version
serving (the model's ComputeTurns): each stage's own self-test (its sample, its recorded outputs), the pipeline's
end-to-end self-test (:func:`end_to_end_self_test`), each stage's largest batch (measured on its own sample and
chosen as a single model's is, unless the operator set ``max_batch_size`` or ``batch_tuning: off``: measured on a
loaded 2-core box, PP-OCRv4's recognizer ran 60 ms a crop alone and 130 ms a crop in batches of 16, so a device may
well choose batches of 1 there) and each stage's warm-up. Any failure leaves the old version serving.

The end-to-end self-test runs the bundle's ``selftest`` sample (``input:<detector input>``) through both engines
and the steps and compares with its ``expected:<end output>``: per image the same number of boxes; each expected
box matched to a box found here, every coordinate within :data:`BOX_TOL_PX` pixels plus :data:`BOX_TOL_REL` of
the box's longer side (a CPU whose map differs in a pixel's rounding moves a box by about a pixel); on matched
boxes the decoded strings byte for byte (CTC), or the top class (top-k); box and text scores within
:data:`SCORE_TOL`; every output finite. Strings are compared exactly because a string is the pipeline's answer:
a CPU that reads one character differently from the build answers differently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ...engines import Engine, EngineError, load_bundle_engine
from ...judge.errors import InputError
from ...judge.pipeline import Chain
from ...protocol import mqtt as proto
from ...protocol.manifest import Manifest
from ...protocol.roles import role_problem
from ..config import AgentConfig
from ..core.batching.settings import BatchSettings
from ..core.batching.tuning import BatchTuning, batch_ladder, choose_batch_size
from ..core.pipeline import PipelineStages, Stage
from ..errors import BackendError, SelfTestFailed, TrustError
from .runtime_choice import RuntimePick, pick_runtime
from .selftest import Turn, measure_batch_sizes, now, self_test, warm_up
from .store import StagedModel

__all__ = ["BOX_TOL_PX", "BOX_TOL_REL", "SCORE_TOL", "end_to_end_self_test", "prepare"]

log = logging.getLogger("edgefleet.agent.pipeline")

BOX_TOL_PX = 2.0  # a box's coordinate may move this many pixels ...
BOX_TOL_REL = 0.02  # ... plus this fraction of the box's longer side, on another CPU
SCORE_TOL = 0.05  # box and text scores (probabilities), absolute


def check_stage_files(staged: StagedModel) -> None:
    """Each stage's engine and self-test sample are what their roles need (the bundle reader checked the top-level
    manifest's; the files' hashes were checked when the bundle was staged). TrustError naming the stage."""
    p = staged.manifest.pipeline
    assert p is not None
    sizes = {n: e.size_bytes for n, e in staged.manifest.files.items()}
    for st in p.stages:
        problem = role_problem(st, lambda name: open(staged.directory / name, "rb"), sizes)
        if problem:
            raise TrustError(f"pipeline stage {st.name!r}: {problem}")
        if len(st.inputs) != 1 or st.inputs[0].batch_axis != 0:
            raise TrustError(f"pipeline stage {st.name!r} takes {len(st.inputs)} inputs "
                             f"({[i.name for i in st.inputs]}); a stage of a detect-then-read pipeline takes one "
                             "image batch, batched on its first axis")


def pipeline_size(manifest: Manifest) -> tuple[int, int] | None:
    """The images a pipeline reads (height, width) as its manifest says: the input's fixed dimensions, else its
    image preprocessing; None when neither says (then its self-test sample's size)."""
    shape = manifest.inputs[0].shape
    if len(shape) != 4:
        raise TrustError(f"a pipeline's input is an NCHW image batch; {manifest.inputs[0].name!r} is {list(shape)}")
    if shape[2] > 0 and shape[3] > 0:
        return int(shape[2]), int(shape[3])
    pp = manifest.preprocessing
    return (pp.height, pp.width) if pp is not None else None


def _stage_settings(base: BatchSettings, formed: int, accepted: int, queue: int) -> BatchSettings:
    """``base`` with batches of at most ``formed`` items, requests of up to ``accepted`` (a larger one than ``formed``
    runs alone) and ``queue`` items waiting."""
    n = max(1, formed)
    return BatchSettings(**{**base.__dict__, "max_batch_size": n,
                            "preferred_batch_sizes": tuple(p for p in base.preferred_batch_sizes if p <= n),
                            "max_request_batch_size": max(n, accepted), "max_queue_size": max(queue, accepted)})


def _tune(backend: Engine, staged: StagedModel, limit: int, config: AgentConfig, turn: Turn
          ) -> tuple[int, BatchTuning]:
    """A stage's largest batch, chosen as a single model's is (agent.install.job.Installer.tune_batches): measured here
    at 1, 2, 4, ... ``limit`` items on the stage's own sample and the smallest size within BATCH_TOLERANCE of the
    best items/s kept, unless ``batch_tuning: off`` or the operator set max_batch_size (then ``limit``)."""
    operator = "max_batch_size" in config.model_fields_set
    if config.batch_tuning == "off" or operator or limit == 1:
        return limit, BatchTuning("operator" if operator else "off")
    figures = measure_batch_sizes(backend, staged, batch_ladder(limit), turn)
    chosen = choose_batch_size(figures)
    log.info("%s %s, stage %s: batches of at most %d (items/s by batch size: %s)", staged.manifest.name,
             staged.manifest.version, staged.manifest.name, chosen, ", ".join(f"{n}: {v:g}" for n, v in figures))
    return chosen, BatchTuning("measured", figures, chosen)


def prepare(staged: StagedModel, config: AgentConfig, base: BatchSettings, turn: Turn = now) -> PipelineStages:
    """Load both stages of a staged pipeline bundle, each from its own manifest, and check them: each stage's own
    self-test, the end-to-end self-test, a warm-up at the batch sizes each stage forms; each call in ``turn`` (with
    the version serving). ``base``: the agent's batch settings. Raises an UpdateError (the old version serves on)."""
    m = staged.manifest
    p = m.pipeline
    assert p is not None
    check_stage_files(staged)
    det_m, rec_m = p.detector, p.reader
    spec = p.spec
    max_images = max(1, spec.max_crops // spec.boxes.max_boxes)
    loaded: list[Engine] = []

    def stage_staged(sm: Manifest) -> StagedModel:
        return StagedModel(sm, staged.directory, staged.bundle_sha256)

    def load_stage(sm: Manifest) -> tuple[tuple[Engine, ...], RuntimePick]:
        def one(runtime: str) -> Engine:
            try:
                return load_bundle_engine(sm, staged.directory / sm.engine, config.intra_op_threads,
                                          config.onnxruntime_providers, runtime)
            except EngineError as exc:
                raise BackendError(f"pipeline stage {sm.name!r}: {exc}") from exc

        pick = pick_runtime(stage_staged(sm), config.runtime, one, base.max_batch_size, turn)
        log.info("%s %s, stage %s: runtime %s", m.name, m.version, sm.name, pick.note)
        engines = []
        for _ in range(config.instances):
            engines.append(one(pick.runtime))
            loaded.append(engines[-1])
        return tuple(engines), pick

    try:
        det_engines, det_pick = load_stage(det_m)
        rec_engines, rec_pick = load_stage(rec_m)
        for sm, engines in ((det_m, det_engines), (rec_m, rec_engines)):
            try:
                self_test(engines[0], stage_staged(sm), turn)
            except SelfTestFailed as exc:
                raise SelfTestFailed(f"pipeline stage {sm.name!r}: {exc}") from exc
        size = pipeline_size(m)
        result, sample_size = end_to_end_self_test(staged, det_engines[0], rec_engines[0], turn, rec_batch=min(
            base.max_batch_size, max(1, spec.max_crops)))
        if size is None:
            size = sample_size
        elif size != sample_size:
            raise SelfTestFailed(f"the pipeline's self-test sample holds {sample_size[0]}x{sample_size[1]} images; "
                                 f"its manifest says it reads {size[0]}x{size[1]}")
        # images: requests of up to max_images; crops: as many as the images waiting could give (the runner bounds
        # the images), sent in pieces of at most the reader's largest batch
        det_n, det_tuning = _tune(det_engines[0], stage_staged(det_m), min(base.max_batch_size, max_images), config,
                                  turn)
        rec_n, rec_tuning = _tune(rec_engines[0], stage_staged(rec_m), base.max_batch_size, config, turn)
        det = Stage(det_m, det_engines, _stage_settings(base, det_n, max_images, base.max_queue_size), det_pick,
                    det_tuning)
        rec = Stage(rec_m, rec_engines, _stage_settings(base, rec_n, rec_n, base.max_queue_size * spec.boxes.max_boxes),
                    rec_pick, rec_tuning)
        for st in (det, rec):
            sizes = tuple(sorted({1, st.settings.max_batch_size}))
            try:
                warm_up(list(st.backends), stage_staged(st.manifest), sizes, turn)
            except SelfTestFailed as exc:
                raise SelfTestFailed(f"pipeline stage {st.manifest.name!r}: {exc}") from exc
    except BaseException:
        for e in loaded:
            e.close()
        raise
    return PipelineStages(det, rec, size, result)


def end_to_end_self_test(staged: StagedModel, detector: Engine, reader: Engine, turn: Turn = now,
                         rec_batch: int = 16) -> tuple[proto.SelfTestResult, tuple[int, int]]:
    """The bundle's own sample through both engines and the steps, against the end outputs it records (see the
    module docstring for what is compared and how closely) -> the figures and the sample's image size."""
    m = staged.manifest
    p = m.pipeline
    assert p is not None
    path = staged.directory / m.selftest
    try:
        with np.load(path, allow_pickle=False) as npz:
            images = npz[f"input:{m.inputs[0].name}"]
            expected = [npz[f"expected:{o.name}"] for o in m.outputs]
    except (KeyError, ValueError, OSError) as exc:
        raise SelfTestFailed(f"the pipeline's self-test sample {path.name} is unreadable: {exc}") from exc
    if images.ndim != 4 or images.dtype != np.float32:
        raise SelfTestFailed(f"the pipeline's self-test input is {images.dtype} {list(images.shape)}; an NCHW FP32 "
                             "image batch was expected")
    size = (int(images.shape[2]), int(images.shape[3]))
    det_in, rec_in = p.detector.inputs[0].name, p.reader.inputs[0].name
    chain = Chain(p.spec, size, [o.name for o in p.detector.outputs], [o.name for o in p.reader.outputs])
    try:
        got = chain.run(images, lambda b: turn(detector.infer, {det_in: b}),
                        lambda b: turn(reader.infer, {rec_in: np.ascontiguousarray(b)}), rec_batch)
    except InputError as exc:
        raise SelfTestFailed(f"the pipeline failed on its own sample: {exc}") from exc
    except Exception as exc:  # the runtimes' own error types
        raise SelfTestFailed(f"the pipeline's engines failed on its own sample: {exc}") from exc
    return compare_ends(p.spec.read.op, m, got, expected), size


def compare_ends(op: str, m: Manifest, got: Sequence[np.ndarray], expected: Sequence[np.ndarray]
                 ) -> proto.SelfTestResult:
    """End outputs found here against the recorded ones (SelfTestFailed naming the image and box that differ)."""
    names = [o.name for o in m.outputs]
    for name, g, e in zip(names, got, expected, strict=True):
        if g.shape != e.shape:
            raise SelfTestFailed(f"self-test: output {name!r} has shape {list(g.shape)}, expected {list(e.shape)}")
        if g.dtype.kind == "f" and not np.isfinite(g).all():
            raise SelfTestFailed(f"self-test: output {name!r} has NaN or infinite values on this device")
    boxes, scores, count, answer, answer_scores = got
    e_boxes, e_scores, e_count, e_answer, e_answer_scores = expected
    worst = 0.0  # the largest box move, as a fraction of its tolerance
    same = total = 0
    for i in range(len(e_count)):
        k = int(e_count[i])
        if int(count[i]) != k:
            raise SelfTestFailed(f"self-test: image {i}: {int(count[i])} boxes found on this device, {k} at build")
        free = list(range(k))
        for j in range(k):
            want = e_boxes[i, j]
            tol = BOX_TOL_PX + BOX_TOL_REL * float(max(want[2] - want[0], want[3] - want[1]))
            diffs = [float(np.abs(boxes[i, c] - want).max()) for c in free]
            best = int(np.argmin(diffs))
            c, d = free.pop(best), diffs[best]
            if d > tol:
                raise SelfTestFailed(f"self-test: image {i}: box {j} {np.round(want, 1).tolist()} moved by {d:.3g} "
                                     f"px on this device (tolerance {tol:.3g})")
            worst = max(worst, d / tol)
            if abs(float(scores[i, c]) - float(e_scores[i, j])) > SCORE_TOL:
                raise SelfTestFailed(f"self-test: image {i}: box {j}'s score is {float(scores[i, c]):.4f} on this "
                                     f"device, {float(e_scores[i, j]):.4f} at build (tolerance {SCORE_TOL})")
            if op == "ctc":
                a, b = bytes(answer[i, c]).rstrip(b"\0"), bytes(e_answer[i, j]).rstrip(b"\0")
                if a != b:
                    raise SelfTestFailed(f"self-test: image {i}: box {j} reads {a.decode('utf-8', 'replace')!r} on "
                                         f"this device, {b.decode('utf-8', 'replace')!r} at build")
                s_got, s_want = float(answer_scores[i, c]), float(e_answer_scores[i, j])
            else:
                if int(answer[i, c, 0]) != int(e_answer[i, j, 0]):
                    raise SelfTestFailed(f"self-test: image {i}: box {j} is class {int(answer[i, c, 0])} on this "
                                         f"device, {int(e_answer[i, j, 0])} at build")
                s_got, s_want = float(answer_scores[i, c, 0]), float(e_answer_scores[i, j, 0])
            if abs(s_got - s_want) > SCORE_TOL:
                raise SelfTestFailed(f"self-test: image {i}: box {j}'s answer scores {s_got:.4f} on this device, "
                                     f"{s_want:.4f} at build (tolerance {SCORE_TOL})")
            same += 1
            total += 1
    return proto.SelfTestResult(samples=len(e_count), top1=None,
                                top1_agreement=round(same / total, 6) if total else None, drift=round(worst, 4))
