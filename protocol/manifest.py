"""The bundle manifest: what the compiler promises and the agent checks.

A bundle is a tar archive holding ``manifest.json``, the engine file and a self-test sample.
``manifest_version`` says which contract the manifest follows; an agent refuses a newer one.

Version 2 adds what makes a build portable and its choices auditable: the CPU features the engine
needs (``cpu_features``), the INT8 scheme and why (``quantization``), the build host's CPU
(``build_host``), how the precision was chosen with every candidate's figures
(``precision_choice``), and the self-test sample's own top-1 (``selftest_summary``), which the
agent measures again on its CPU. Version 1 manifests still parse, with those fields empty.

Version 3 adds the task gate (``accuracy.task``): what the model is for (classification, detection,
ctc, segmentation, regression, embedding), how that was decided, and each task criterion with its
value, bound and 95% interval. A manifest is written at the lowest version that carries its content:
a bundle without a task gate (e.g. one gated on labels) stays version 2, so an older agent still
reads it; one with a task gate is version 3, and an older agent refuses it with "upgrade the agent"
rather than a schema error about an unknown key.

Version 4 adds precision chosen on the device (``variants``): when the build host cannot time the
profile's CPUs (another architecture, or features it lacks), the bundle carries every precision that
passed the gate, each with its own engine, self-test sample and gate report; the manifest's own engine
is the first of them in the profile's order (what an agent that does not time serves), and
``precision_choice.mode`` is ``device``. The agent times them on its own cores at install and serves
the fastest (:meth:`Manifest.as_variant` gives the manifest as that precision's).

Version 5 adds bf16 (the same ONNX file as fp32, run by OpenVINO with its bf16 inference precision on CPUs with
avx512_bf16 or amx_bf16), as the manifest's precision or a variant's. A bf16 engine is gated like int8, and the
manifest proves it: its accuracy report judged bf16 against fp32 and passed, ``precision_choice`` lists bf16 with
its gate figures, and ``cpu_features`` promises a bf16 instruction set, so an agent without one refuses the bundle
before downloading it. A manifest without bf16 stays at its lower version.

Version 6 adds the drift reference (``drift``, protocol/drift.py): the fp32 model's answers on the evaluation set as
a few binned features of its task (class shares, score deciles, boxes per image, string lengths, speech share, a
value sketch), which agents count their live answers into and the fleet scores them against. A manifest without it
stays at its lower version.

Version 7 adds pipelines (``pipeline``, protocol/pipeline.py): two models run as one, a detector then a reader, with
the steps between them. Each stage has its own manifest inside (gated like a single model, its files listed in the
bundle's ``files``); the top-level manifest describes the pipeline as a whole: its input is the detector's, its
outputs are the end answers, its ``accuracy`` is the gate of those answers against the FP32 pipeline (task
``pipeline``), its ``engine`` is the detector's engine file and its ``precision`` the lowest of the stages'
(``fp32`` only when every stage is fp32), and its ``drift`` reference, when it has one, reads those end answers
(``read_as: pipeline``: boxes per image, each string's length or top class, each string's score). A manifest without
it stays at its lower version.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from . import jsonlimits
from ._strict import StrictModel, parse_document
from .drift import DriftReference
from .errors import SchemaError, UnsupportedVersionError
from .pipeline import PipelineSpec, end_output_names
from .preprocess import Preprocessing

__all__ = [
    "BF16_VERSION",
    "BUILD_NOTES_VERSION",
    "DRIFT_VERSION",
    "FIXED_BATCH_VERSION",
    "JUDGED_VERSION",
    "MANIFEST_FILENAME",
    "MANIFEST_VERSION",
    "MAX_MANIFEST_BYTES",
    "AccuracyReport",
    "BenchmarkPoint",
    "BenchmarkReport",
    "BuildHost",
    "BuildNote",
    "EngineVariant",
    "FileEntry",
    "Int8Scheme",
    "Manifest",
    "OutputAgreement",
    "PipelineManifest",
    "PrecisionCandidate",
    "PrecisionChoice",
    "QuantizationInfo",
    "SelfTestSummary",
    "TaskCriterion",
    "TaskReport",
    "TensorSpec",
    "parse_manifest",
]

MANIFEST_VERSION = 8
JUDGED_VERSION = 8  # the first version with accuracy.not_judged and task keypoints
PIPELINE_VERSION = 7  # the first version with pipeline (two models run as one)
TASK_GATE_VERSION = 3  # the first version with accuracy.task
VARIANTS_VERSION = 4  # the first version with variants (precision chosen on the device)
DRIFT_VERSION = 6  # the first version with drift (the reference of the model's answers)
BF16_VERSION = 5  # the first version with bf16 engines
BUILD_NOTES_VERSION = 8  # the first version with build_notes
FIXED_BATCH_VERSION = 8  # the first version with fixed_batch
MANIFEST_FILENAME = "manifest.json"
MAX_MANIFEST_BYTES = 1024**2  # a manifest is a few KiB; one over this is refused unread

Backend = Literal["onnxruntime", "litert", "tensorrt"]
Precision = Literal["fp32", "fp16", "int8", "bf16"]
# bf16 engines need one of these (protocol.cpu.BF16_FEATURES; repeated here: the manifest imports no cpu probing)
_BF16_FEATURES = ("avx512_bf16", "amx_bf16")
# onnxruntime's x86 layouts (see protocol.profile.QuantizationSettings); s8s8: TFLite / TensorRT int8
Int8Scheme = Literal["u8s8", "u8s8_reduced", "u8u8", "s8s8"]
DType = Literal["FP32", "FP16", "INT8", "UINT8", "INT32", "INT64", "BOOL"]

# used with fullmatch: no trailing newline, ASCII digits only
NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
VERSION_RE = re.compile(r"(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})")
SHA256_RE = re.compile(r"[0-9a-f]{64}")


def version_key(version: str) -> tuple[int, int, int]:
    """Order of model versions ("1.2.10" > "1.2.9")."""
    if not VERSION_RE.fullmatch(version):
        raise ValueError(f"version {version!r} is not MAJOR.MINOR.PATCH")
    a, b, c = (int(p) for p in version.split("."))
    return (a, b, c)


class TensorSpec(StrictModel):
    name: str = Field(min_length=1)
    datatype: DType
    shape: tuple[int, ...]  # -1 marks a dynamic dimension; the batch dimension is always -1
    # which dimension is the batch: 0 for almost every model, 1 for recurrent state laid out as
    # [layers, N, hidden]; None for a tensor with no batch at all (a parameter shared by the whole
    # batch, e.g. a scalar). A model with such an input is served one request at a time.
    batch_axis: int | None = 0

    @model_validator(mode="after")
    def _batch(self) -> TensorSpec:
        if any(d == 0 or d < -1 for d in self.shape):
            raise ValueError("dimensions are positive or -1")
        if self.batch_axis is not None:
            if not 0 <= self.batch_axis < len(self.shape):
                raise ValueError(f"batch_axis {self.batch_axis} is outside the shape {list(self.shape)}")
            if self.shape[self.batch_axis] != -1:
                raise ValueError(f"the batch dimension ({self.batch_axis}) must be dynamic (-1)")
        return self


class FileEntry(StrictModel):
    sha256: str
    size_bytes: int = Field(ge=0)

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not SHA256_RE.fullmatch(v):
            raise ValueError("sha256 must be 64 lowercase hex digits")
        return v


class OutputAgreement(StrictModel):
    """One output of the candidate engine against fp32 on the evaluation set."""

    name: str
    metric: Literal["top1_agreement", "cosine"]  # the one the agreement gate uses for this output
    value: float = Field(ge=-1.0, le=1.0)
    top1_agreement: float | None = Field(default=None, ge=0.0, le=1.0)
    cosine: float = Field(ge=-1.0, le=1.0)  # the worst sample's
    max_abs_error: float = Field(ge=0.0)
    mean_abs_error: float = Field(ge=0.0)


class TaskCriterion(StrictModel):
    """One thing the task gate checks: ``value`` (a fraction) must be >= ``bound`` (kind min) or <= it (max)."""

    name: str = Field(min_length=1, max_length=64)  # top1_agreement, box_recall, char_error_rate, mask_iou, ...
    value: float = Field(ge=0.0, le=1.0)
    bound: float = Field(ge=0.0, le=1.0)
    kind: Literal["min", "max"]
    ci95: tuple[float, float] | None = None  # 95% interval of the value on the evaluation set
    passed: bool


class TaskReport(StrictModel):
    """The candidate judged against fp32 by what the model is for (version 3)."""

    # pipeline (version 7): the end answers of a pipeline against the fp32 pipeline's
    task: Literal["classification", "detection", "ctc", "segmentation", "regression", "embedding", "keypoints",
                  "pipeline"]
    source: Literal["declared", "file", "inferred"]
    output: str
    args: dict[str, str] = Field(default_factory=dict)
    note: str = ""
    metric: str  # the task's headline criterion (the first of ``criteria``)
    value: float = Field(ge=0.0, le=1.0)
    ci95: tuple[float, float] | None = None
    criteria: tuple[TaskCriterion, ...] = Field(min_length=1)
    passed: bool
    details: dict[str, float] = Field(default_factory=dict)  # box counts, max abs error, threshold, ...

    @model_validator(mode="after")
    def _consistent(self) -> TaskReport:
        if self.passed != all(c.passed for c in self.criteria):
            raise ValueError("passed does not agree with the criteria")
        return self


class AccuracyReport(StrictModel):
    # top1: against labels (drop = fp32 top-1 - candidate top-1); agreement: no labels, reference 1.0 and
    # candidate = the worst output's agreement with fp32 (top-1 agreement or cosine similarity)
    metric: Literal["top1", "agreement"]
    eval_samples: int = Field(gt=0)
    reference_precision: Precision
    reference: float = Field(ge=0.0, le=1.0)
    candidate_precision: Precision
    candidate: float = Field(ge=0.0, le=1.0)
    drop: float
    max_drop: float = Field(ge=0.0)
    passed: bool
    outputs: tuple[OutputAgreement, ...] = ()
    drop_ci95: tuple[float, float] | None = None  # paired 95% interval of the drop (top1 per sample)
    # version 3: the task gate (metric "agreement": candidate is the score of the criterion with the least room)
    task: TaskReport | None = None
    # version 8: the outputs neither labels nor a task judged (their figures are in ``outputs`` and the task's details)
    not_judged: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> AccuracyReport:
        if abs(self.drop - (self.reference - self.candidate)) > 1e-5:
            raise ValueError("drop must equal reference - candidate")
        if self.passed != (self.drop <= self.max_drop + 1e-9):
            raise ValueError("passed does not agree with drop <= max_drop")
        return self


class BenchmarkPoint(StrictModel):
    batch_size: int = Field(gt=0)
    reference_ms_p50: float = Field(ge=0)
    candidate_ms_p50: float = Field(ge=0)
    speedup: float = Field(ge=0)  # reference / candidate p50, measured alternating in one run
    reference_ms_p99: float | None = Field(default=None, ge=0)
    candidate_ms_p99: float | None = Field(default=None, ge=0)
    candidate_items_per_s: float | None = Field(default=None, ge=0)  # batch_size / candidate p50


class BenchmarkReport(StrictModel):
    threads: int = Field(gt=0)
    iterations: int = Field(gt=0)
    points: tuple[BenchmarkPoint, ...]
    reference_precision: Precision = "fp32"
    candidate_precision: Precision | None = None  # None in version 1: the manifest's precision


class QuantizationInfo(StrictModel):
    """How an INT8 engine was quantized, and why that way."""

    scheme: Int8Scheme
    activation_type: Literal["uint8", "int8"]
    weight_type: Literal["uint8", "int8"]
    weight_bits: int = Field(ge=2, le=8)  # 7 with u8s8_reduced
    per_channel: bool
    calibration_method: Literal["minmax", "entropy", "percentile"]
    calibration_samples: int = Field(gt=0)
    reason: str
    # the float fallback: layers kept in float to meet the gate, the steps it took, and its speed cost
    float_nodes: tuple[str, ...] = ()
    fallback_steps: tuple[str, ...] = ()
    fallback_speed: tuple[BenchmarkPoint, ...] = ()  # this engine vs the all-int8 one (speedup < 1: slower)


class BuildHost(StrictModel):
    """The machine the compiler ran on: its figures (benchmark, gate) were measured there."""

    arch: str
    cpu_features: tuple[str, ...]


class BuildNote(StrictModel):
    """One thing the build did beside the plain path (version 8): a quantizer retry with another option, a float
    fallback step, a graph edit, the weights of external data embedded. ``step``: where (e.g. "int8 quantizer");
    ``action``: what was done; ``reason``: why (the failure or figure that made it)."""

    step: str = Field(min_length=1, max_length=200)
    action: str = Field(min_length=1, max_length=1000)
    reason: str = Field(max_length=2000)


class PrecisionCandidate(StrictModel):
    precision: Precision
    top1: float | None = Field(default=None, ge=0.0, le=1.0)  # the gate's figure: top-1, or agreement
    metric: Literal["top1", "agreement"] | None = None
    drop: float | None = None
    passed: bool | None = None  # None: not built or not gated
    speedup: tuple[BenchmarkPoint, ...] = ()  # vs fp32, alternating in one run
    note: str | None = None  # e.g. why it was not built


class PrecisionChoice(StrictModel):
    # auto: the compiler chose on the build host; fixed: --precision; device: the agent times the bundle's
    # precisions (the manifest's own and its variants) on its own cores and serves the fastest (version 4)
    mode: Literal["auto", "fixed", "device"]
    chosen: Precision
    reason: str
    candidates: tuple[PrecisionCandidate, ...]


class SelfTestSummary(StrictModel):
    """The self-test sample as the compiler ran it; the agent repeats it on its own CPU."""

    samples: int = Field(gt=0)
    top1: float | None = Field(default=None, ge=0.0, le=1.0)  # against the sample's labels, when it has them


class EngineVariant(StrictModel):
    """Another precision of the same model in the bundle, gated like the manifest's own engine (version 4)."""

    precision: Precision
    engine: str  # file names inside the bundle, listed in the manifest's ``files``
    selftest: str
    accuracy: AccuracyReport
    quantization: QuantizationInfo | None = None
    selftest_summary: SelfTestSummary | None = None


class Manifest(StrictModel):
    manifest_version: int
    name: str
    version: str
    profile: str
    backend: Backend
    precision: Precision
    created_at: str
    engine: str  # file name of the engine inside the bundle
    selftest: str  # npz with "inputs" and "expected" for the agent's self-test
    inputs: tuple[TensorSpec, ...] = Field(min_length=1)
    outputs: tuple[TensorSpec, ...] = Field(min_length=1)
    files: dict[str, FileEntry]
    accuracy: AccuracyReport
    benchmark: BenchmarkReport | None
    toolchain: dict[str, str]
    labels: tuple[str, ...] | None = None
    # version 2
    cpu_features: tuple[str, ...] = ()  # instruction sets the engine needs (the profile's promise)
    quantization: QuantizationInfo | None = None  # None for float engines
    build_host: BuildHost | None = None
    precision_choice: PrecisionChoice | None = None
    selftest_summary: SelfTestSummary | None = None
    # what the engine file is tied to beyond the CPU (TensorRT: version, GPU compute capability, JetPack)
    engine_compatibility: dict[str, str] = Field(default_factory=dict)
    # how an image becomes the model's input (the agent's image endpoint applies the same)
    preprocessing: Preprocessing | None = None
    # version 4: the other precisions that passed the gate, for the device to time (precision_choice.mode device)
    variants: tuple[EngineVariant, ...] = Field(default=(), max_length=4)
    # version 6: how the model's answers on the evaluation set look (None: not recorded; the fleet shows no drift)
    drift: DriftReference | None = None
    # version 7: the stages and steps when this bundle is a pipeline (None: one model)
    pipeline: PipelineManifest | None = None
    # version 8: every retry, fallback and workaround of the build, in the order they happened
    build_notes: tuple[BuildNote, ...] = Field(default=(), max_length=256)
    # version 8: the engine file runs exactly this batch (an export that fixed it and whose graph cannot take another):
    # the inputs and outputs above are as callers see them (batch dynamic); the engine pads a smaller batch up to it
    # and slices the outputs, and runs a larger one in pieces of this size (engines.base.Engine.infer)
    fixed_batch: int | None = Field(default=None, ge=2, le=65536)

    @field_validator("name", "profile")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError("names are 1-63 of [a-z0-9._-], starting with a letter or digit")
        return v

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        version_key(v)
        return v

    @model_validator(mode="after")
    def _files_listed(self) -> Manifest:
        roles = [("engine", self.engine), ("selftest", self.selftest)]
        for v in self.variants:
            roles += [(f"{v.precision} engine", v.engine), (f"{v.precision} selftest", v.selftest)]
        for role, fname in roles:
            if fname not in self.files:
                raise ValueError(f"{role} file {fname!r} is not listed in 'files'")
        for fname in self.files:
            if "/" in fname or "\\" in fname or fname in ("", ".", "..") or fname == MANIFEST_FILENAME:
                raise ValueError(f"file name {fname!r} must be a plain name inside the bundle")
        return self

    @model_validator(mode="after")
    def _version_carries_content(self) -> Manifest:
        if self.accuracy.task is not None and self.manifest_version < TASK_GATE_VERSION:
            raise ValueError(f"accuracy.task needs manifest_version {TASK_GATE_VERSION} or newer")
        if self.manifest_version < JUDGED_VERSION and any(
                a.not_judged or (a.task is not None and a.task.task == "keypoints")
                for a in (self.accuracy, *(v.accuracy for v in self.variants))):
            raise ValueError(f"accuracy.not_judged and task keypoints need manifest_version {JUDGED_VERSION} or newer")
        if self.fixed_batch is not None and self.manifest_version < FIXED_BATCH_VERSION:
            raise ValueError(f"fixed_batch needs manifest_version {FIXED_BATCH_VERSION} or newer")
        if self.build_notes and self.manifest_version < BUILD_NOTES_VERSION:
            raise ValueError(f"build_notes need manifest_version {BUILD_NOTES_VERSION} or newer")
        if self.drift is not None:
            if self.manifest_version < DRIFT_VERSION:
                raise ValueError(f"drift needs manifest_version {DRIFT_VERSION} or newer")
            if self.drift.output not in [o.name for o in self.outputs]:
                raise ValueError(f"drift.output {self.drift.output!r} is not one of the outputs "
                                 f"{[o.name for o in self.outputs]}")
        if self.variants:
            if self.manifest_version < VARIANTS_VERSION:
                raise ValueError(f"variants need manifest_version {VARIANTS_VERSION} or newer")
            precisions = [self.precision, *(v.precision for v in self.variants)]
            if len(set(precisions)) != len(precisions):
                raise ValueError(f"each precision appears once among the engine and its variants: {precisions}")
            # one role per file: an engine that is another's self-test sample, or a sample shared between
            # precisions (whose expected answers differ), is a crafted bundle, never the compiler's
            roles = [self.engine, self.selftest, *(f for v in self.variants for f in (v.engine, v.selftest))]
            if len(set(roles)) != len(roles):
                raise ValueError("each engine and self-test sample of the bundle and its variants is a file of its "
                                 f"own: {roles}")
            if any(not v.accuracy.passed for v in self.variants):
                raise ValueError("a variant must have passed the accuracy gate")
            if self.precision_choice is None or self.precision_choice.mode != "device":
                raise ValueError("a manifest with variants has precision_choice.mode 'device'")
        elif self.precision_choice is not None and self.precision_choice.mode == "device":
            raise ValueError("precision_choice.mode 'device' needs variants to choose among")
        return self

    @model_validator(mode="after")
    def _pipeline_whole(self) -> Manifest:
        """A pipeline's manifest describes the whole: see the module docstring (version 7)."""
        if self.accuracy.task is not None and self.accuracy.task.task == "pipeline" and self.pipeline is None:
            raise ValueError("accuracy.task 'pipeline' belongs to a pipeline's manifest")
        if self.drift is not None and (self.drift.read_as == "pipeline") != (self.pipeline is not None):
            raise ValueError("a pipeline's drift reference reads its end answers (drift.read_as 'pipeline'), and only "
                             "a pipeline's does")
        p = self.pipeline
        if p is None:
            return self
        if self.manifest_version < PIPELINE_VERSION:
            raise ValueError(f"pipeline needs manifest_version {PIPELINE_VERSION} or newer")
        names = [s.name for s in p.stages]
        if sorted(names) != sorted([p.spec.detector, p.spec.reader]):
            raise ValueError(f"the stages {names} are not the spec's detector {p.spec.detector!r} and reader "
                             f"{p.spec.reader!r}")
        if p.spec.read.charset_from is not None:
            raise ValueError("pipeline.spec.read.charset_from is for pipeline.yaml; a manifest holds the charset")
        if self.variants:
            raise ValueError("a pipeline has no variants: each stage's precision is chosen when it is built")
        for st in p.stages:
            if st.pipeline is not None:
                raise ValueError(f"stage {st.name!r} is itself a pipeline")
            if st.backend != self.backend:
                raise ValueError(f"stage {st.name!r} runs on {st.backend}, the pipeline on {self.backend}")
            for fname, entry in st.files.items():
                if self.files.get(fname) != entry:
                    raise ValueError(f"stage {st.name!r}'s file {fname!r} is not the bundle's file of that name")
        det = p.stage(p.spec.detector)
        if self.engine != det.engine:
            raise ValueError(f"a pipeline's engine is its detector's ({det.engine!r}), not {self.engine!r}")
        if tuple(self.inputs) != tuple(det.inputs):
            raise ValueError("a pipeline's inputs are its detector's")
        want = end_output_names(p.spec)
        if tuple(o.name for o in self.outputs) != want:
            raise ValueError(f"a pipeline's outputs are {list(want)}, not {[o.name for o in self.outputs]}")
        lowest = next(q for q in ("int8", "fp16", "bf16", "fp32") if q in {s.precision for s in p.stages})
        if self.precision != lowest:
            raise ValueError(f"a pipeline's precision is its lowest stage's ({lowest}), not {self.precision}")
        if self.accuracy.task is None or self.accuracy.task.task != "pipeline":
            raise ValueError("a pipeline's accuracy report judges its end answers (accuracy.task 'pipeline')")
        if self.drift is not None and (self.drift.read != p.spec.read.op or self.drift.output != want[3]):
            raise ValueError(f"a pipeline's drift reference reads its {want[3]!r} as read.op {p.spec.read.op}; it "
                             f"says {self.drift.output!r} as {self.drift.read}")
        return self

    @model_validator(mode="after")
    def _bf16_gated(self) -> Manifest:
        """No bf16 answer without a gate that judged it: see the module docstring (version 5)."""
        engines = [(self.precision, self.accuracy), *((v.precision, v.accuracy) for v in self.variants)]
        bf16 = [acc for p, acc in engines if p == "bf16"]
        if not bf16:
            return self
        if self.manifest_version < BF16_VERSION:
            raise ValueError(f"a bf16 engine needs manifest_version {BF16_VERSION} or newer")
        if self.backend != "onnxruntime":
            raise ValueError(f"bf16 engines are ONNX files run by OpenVINO (backend onnxruntime), not {self.backend}")
        acc = bf16[0]
        if acc.candidate_precision != "bf16" or acc.reference_precision != "fp32":
            raise ValueError(f"the bf16 engine's accuracy report judged {acc.candidate_precision} against "
                             f"{acc.reference_precision}, not bf16 against fp32: no gate judged bf16")
        if not acc.passed:
            raise ValueError("the bf16 engine did not pass the accuracy gate")
        cand = next((c for c in self.precision_choice.candidates if c.precision == "bf16"), None) \
            if self.precision_choice is not None else None
        if cand is None or cand.passed is not True or cand.top1 is None or cand.metric is None:
            raise ValueError("precision_choice lists no passing bf16 candidate with its gate figures (top1, metric, "
                             "passed): a bf16 engine ships only with the figures of the gate that judged it")
        if not set(self.cpu_features) & set(_BF16_FEATURES):
            raise ValueError(f"a bf16 engine runs only on CPUs with {' or '.join(_BF16_FEATURES)}, and cpu_features "
                             f"{list(self.cpu_features)} promise neither")
        return self

    @property
    def precisions(self) -> tuple[str, ...]:
        """Every precision the bundle can serve: its own first, then its variants'."""
        return (self.precision, *(v.precision for v in self.variants))

    def as_variant(self, precision: str) -> Manifest:
        """The manifest as the given precision's: its engine, self-test sample, gate report and quantization in
        place of the bundle's own (the others become its variants), for the agent to serve and self-test."""
        if precision == self.precision:
            return self
        v = next((v for v in self.variants if v.precision == precision), None)
        if v is None:
            raise ValueError(f"the bundle has no {precision} engine (it has {', '.join(self.precisions)})")
        own = EngineVariant(precision=self.precision, engine=self.engine, selftest=self.selftest,
                            accuracy=self.accuracy, quantization=self.quantization,
                            selftest_summary=self.selftest_summary)
        others = tuple(own if x is v else x for x in self.variants)
        return self.model_copy(update={
            "precision": v.precision, "engine": v.engine, "selftest": v.selftest, "accuracy": v.accuracy,
            "quantization": v.quantization, "selftest_summary": v.selftest_summary, "variants": others})

    @property
    def batchable(self) -> bool:
        """Requests can be stacked into one batch: every input has a batch dimension."""
        return all(t.batch_axis is not None for t in self.inputs)

    def to_json(self) -> str:
        """As written into a bundle: version-3 keys left out when unset, so a version-2 manifest is exactly
        what a version-2 agent parses."""
        data = self.model_dump(mode="json")
        for acc in [data["accuracy"], *(v["accuracy"] for v in data.get("variants", ()))]:
            if acc.get("task") is None:
                acc.pop("task", None)
            if not acc.get("not_judged"):
                acc.pop("not_judged", None)
        if not data.get("variants"):
            data.pop("variants", None)
        if not data.get("build_notes"):
            data.pop("build_notes", None)
        if data.get("fixed_batch") is None:
            data.pop("fixed_batch", None)
        if data.get("drift") is None:
            data.pop("drift", None)
        if data.get("pipeline") is None:
            data.pop("pipeline", None)
        else:  # each stage's manifest as a stage writes it alone (its unset keys left out)
            data["pipeline"]["stages"] = [json.loads(st.to_json()) for st in self.pipeline.stages]  # type: ignore[union-attr]
        return _json(data) + "\n"


def _json(v: Any, depth: int = 0) -> str:
    """``json.dumps(v, indent=2, sort_keys=True)``, except that a list of plain values (a charset, a shape, labels)
    stays on one line, without spaces: a reader's 6,625-character charset written one entry a line made an OCR
    pipeline's manifest 153 KB, which every version of the bundle downloads again (issue 43: a one-stage change costs
    the stage plus the manifest). The same JSON value either way: any JSON reader parses both the same."""
    pad = "  " * (depth + 1)
    if isinstance(v, dict) and v:
        items = [f"{pad}{json.dumps(k)}: {_json(v[k], depth + 1)}" for k in sorted(v)]
    elif isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):
        items = [f"{pad}{_json(x, depth + 1)}" for x in v]
    else:
        return json.dumps(v, separators=(",", ":")) if isinstance(v, list) else json.dumps(v)
    o, c = ("{", "}") if isinstance(v, dict) else ("[", "]")
    return o + "\n" + ",\n".join(items) + "\n" + "  " * depth + c


class PipelineManifest(StrictModel):
    """The steps (as gated) and each stage's own manifest (version 7)."""

    spec: PipelineSpec
    stages: tuple[Manifest, ...] = Field(min_length=2, max_length=2)

    def stage(self, name: str) -> Manifest:
        return next(s for s in self.stages if s.name == name)

    @property
    def detector(self) -> Manifest:
        return self.stage(self.spec.detector)

    @property
    def reader(self) -> Manifest:
        return self.stage(self.spec.reader)


Manifest.model_rebuild()


def parse_manifest(raw: bytes | str | dict[str, Any], source: str = MANIFEST_FILENAME) -> Manifest:
    """Parse and validate a manifest, refusing one written for a newer contract."""
    if isinstance(raw, dict):
        data = raw
    else:  # bounded: a manifest nested 100,000 deep is a SchemaError, never a RecursionError
        data = jsonlimits.loads(raw, source=source, max_bytes=MAX_MANIFEST_BYTES)
    if not isinstance(data, dict):
        raise SchemaError(source, ["expected a JSON object at the top level"])
    mv = data.get("manifest_version")
    if mv is None:
        raise SchemaError(source, ["missing key 'manifest_version'"])
    if not isinstance(mv, int) or isinstance(mv, bool):
        raise SchemaError(source, ["key 'manifest_version': must be an integer"])
    if mv > MANIFEST_VERSION:
        raise UnsupportedVersionError(
            f"{source}: manifest_version {mv} is newer than this edgefleet understands "
            f"(up to {MANIFEST_VERSION}); upgrade the agent to install this bundle"
        )
    if mv < 1:
        raise SchemaError(source, [f"key 'manifest_version': {mv} is not a valid version"])
    return parse_document(Manifest, data, source)
