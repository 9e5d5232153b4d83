"""What a model is for, and how a built engine is judged against FP32 by that task.

Comparing tensors does not say whether a model still does its job: a detector's argmax over anchors
means nothing, per-step agreement of an OCR recognizer hides changed strings, and cosine on an
``[N, 1]`` probability is always 1. So the gate judges the task:

=================  ==========================================================================
task               criteria (each with a bound; the gate passes when all hold)
=================  ==========================================================================
classification     top-1 agreement with FP32 (per sample)
detection          FP32's boxes (score >= ``score``, NMS) matched by IoU >= ``iou`` with the same
                   class: recall and precision of FP32's boxes, mean IoU of the matches; YOLO heads, boxes and
                   scores as separate outputs (``boxes=``, ``scores=``), or a CenterNet head's maps, with its
                   landmarks judged as keypoints (:mod:`judge.detection`)
keypoints          instances matched (box IoU, or the model's own order), then PCK: the share of FP32's points
                   the candidate keeps within ``pck`` of the instance's size (:mod:`judge.keypoints`)
ctc                greedy CTC decoding (arg-max, collapse repeats, drop ``blank``): exact-string
                   agreement and character error rate against FP32's strings
segmentation       mask IoU per sample (one channel: ``> threshold``; several: arg-max per pixel); one channel:
                   the objects too (connected components of at least ``min_area`` pixels, a text detector's
                   boxes): FP32's matched at IoU 0.5, recall and precision (``min_instances``)
regression         decision agreement at ``threshold`` (probabilities: 0.5 by default, unless ``tol`` is given
                   and the task is not declared ``probabilities``: coordinates in [0, 1] make no decisions); without
                   a threshold, the share of samples within ``tol`` of FP32; max and mean abs error. With
                   ``min_segments`` (a VAD): the evaluation samples in order are one stream, its decisions
                   runs of positives (segments, merged across samples): FP32's matched one to one at
                   interval IoU >= 0.5, recall and precision
embedding          neighbour rank: each candidate embedding's nearest FP32 embedding among the evaluation set's
                   is its own (``min_retrieval``); the 5th-percentile cosine with FP32 (``min_cosine``)
=================  ==========================================================================

The task is declared (``--task NAME --task-args 'k=v,...'``, or a list ``NAME:k=v,...;NAME:output=OUT,...`` for a
model whose outputs serve several tasks), read from ``MODEL.task.yaml`` beside the model, or inferred from the first
output's shape or a CenterNet head's outputs (the inference says how sure it is). Every output no task reads is
measured against FP32 and listed as not judged. Pure functions of arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..protocol.manifest import TaskCriterion, TaskReport, TensorSpec
from .criteria import Outputs, crit, in_unit, mean_ci, samples, wilson
from .dense import embedding, regression, segmentation
from .detection import (
    BOX_FORMATS,
    DETECTION_FORMATS,
    _boxes,  # noqa: F401  (judge.pipeline decodes a detector's boxes with it)
    centernet_roles,
    detection,
    detection_layout,
    yolox_grid,
)
from .errors import InputError
from .keypoints import KEYPOINT_LAYOUTS, choose_layout, keypoints

__all__ = ["TASKS", "Outputs", "TaskSpec", "canonical_task", "infer_task", "judge", "load_task_file", "parse_task_args",
           "parse_tasks", "resolve_task", "samples", "yolox_grid"]

# the judges' helpers under their old names (judge.pipeline and older callers import them from here)
_crit, _wilson, _mean_ci, _in_unit = crit, wilson, mean_ci, in_unit

ALIASES = {"sequence": "ctc", "probabilities": "regression", "probability": "regression", "mask": "segmentation",
           "masks": "segmentation", "landmarks": "keypoints", "pose": "keypoints"}
# task -> its arguments and their defaults (None: chosen from the data or from --min-agreement)
TASKS: dict[str, dict[str, Any]] = {
    "classification": {"min_top1": None},
    "detection": {"format": "yolov8", "score": 0.25, "iou": 0.5, "nms": 0.7, "min_recall": 0.98,
                  "min_precision": 0.98, "min_iou": 0.8, "input_h": None, "input_w": None,
                  "wh": None, "offset": None, "landmarks": None, "top_k": 100, "pck": 0.05, "min_pck": 0.98,
                  "boxes": None, "scores": None, "box_format": "xyxy"},
    "keypoints": {"boxes": None, "layout": "xy", "iou": 0.5, "pck": 0.05, "min_pck": 0.98, "min_instances": 0.98},
    "ctc": {"blank": 0, "min_exact": 0.98, "max_cer": 0.02},  # at most 2% of the strings change
    "segmentation": {"threshold": None, "min_iou": 0.9, "min_instances": 0.98, "min_area": 10},
    "regression": {"threshold": None, "min_decision": None, "tol": None, "min_within": 0.99, "min_segments": None},
    "embedding": {"min_cosine": None, "min_retrieval": 0.98},
}
# arguments that name another output the task reads (detection format centernet, keypoints' boxes)
OUTPUT_ARGS = ("wh", "offset", "landmarks", "boxes", "scores")
MAX_TASKS = 8  # tasks in one --task list
# the bound --min-agreement sets, per task, when --task-args does not set it
PRIMARY_BOUND = {"classification": "min_top1", "detection": "min_recall", "ctc": "min_exact",
                 "segmentation": "min_iou", "regression": "min_decision", "embedding": "min_cosine",
                 "keypoints": "min_pck"}


@dataclass(frozen=True)
class TaskSpec:
    name: str
    output: str  # the output it judges
    args: dict[str, Any] = field(default_factory=dict)  # as given (validated), defaults not filled in
    source: str = "declared"  # declared | file | inferred
    note: str = ""  # how it was decided, for the progress output and the manifest
    sure: bool = True  # an inferred task whose evidence is not conclusive is not sure: it never gates int8

    def arg(self, key: str) -> Any:
        return self.args.get(key, TASKS[self.name][key])

    def also(self) -> list[TaskSpec]:
        """The other tasks of a --task list (``args["also"]``), each on its own outputs."""
        text = self.args.get("also")
        return [TaskSpec(t, str(a["output"]), {k: v for k, v in a.items() if k != "output"}, self.source,
                         f"task {t} on output {a['output']!r}")
                for t, a in (parse_tasks(str(text), None, "accuracy.task.args.also") if text else [])]

    def reads(self) -> tuple[str, ...]:
        """Every output this task (with its --task list) reads."""
        own = [self.output, *(str(self.args[k]) for k in OUTPUT_ARGS if self.args.get(k) is not None)]
        return tuple(dict.fromkeys([*own, *(o for t in self.also() for o in t.reads())]))

    @classmethod
    def from_report(cls, report: TaskReport) -> TaskSpec:
        """The task a manifest recorded, to judge again (``edgefleet verify``)."""
        args = {k: _coerce(report.task, k, v, "manifest accuracy.task.args") for k, v in report.args.items()}
        return cls(report.task, report.output, args, report.source, report.note)

    def with_min_agreement(self, value: float | None) -> TaskSpec:
        """--min-agreement given on the command line bounds the task's headline criterion."""
        key = PRIMARY_BOUND[self.name]
        if value is None or key in self.args:
            return self
        extra = {"min_within": value} if self.name == "regression" and "min_within" not in self.args else {}
        return TaskSpec(self.name, self.output, {**self.args, key: value, **extra}, self.source, self.note, self.sure)


def canonical_task(name: str, where: str) -> str:
    task = ALIASES.get(name.strip().lower(), name.strip().lower())
    if task not in TASKS:
        raise InputError(f"{where}: unknown task {name!r}; tasks are {', '.join(TASKS)} (aliases: "
                         f"{', '.join(f'{a}={t}' for a, t in ALIASES.items())})")
    return task


def _coerce(task: str, key: str, value: Any, where: str) -> Any:
    if key in ("output", *OUTPUT_ARGS) and key in ("output", *TASKS[task]):
        return str(value)
    if key == "also":
        parse_tasks(str(value), None, where)
        return str(value)
    if key not in TASKS[task]:
        raise InputError(f"{where}: {task} takes no argument {key!r}; it takes "
                         f"{', '.join(['output', *TASKS[task]])}")
    if key == "layout" and task == "keypoints":
        if str(value) not in KEYPOINT_LAYOUTS:
            raise InputError(f"{where}: keypoints layout={value!r} is not one of {', '.join(KEYPOINT_LAYOUTS)} (a [2K] "
                             "vector of points: xy interleaved x0, y0, x1, y1, ... or xxyy: x0..xK-1, then y0..yK-1)")
        return str(value)
    if key == "box_format" and task == "detection":
        if str(value) not in BOX_FORMATS:
            raise InputError(f"{where}: detection box_format={value!r} is not one of {', '.join(BOX_FORMATS)} (how the "
                             "boxes= output gives each box: corners x0, y0, x1, y1 or centre and size cx, cy, w, h)")
        return str(value)
    if key == "format":
        if str(value) not in DETECTION_FORMATS:
            raise InputError(f"{where}: detection format {value!r} is not one of {', '.join(DETECTION_FORMATS)} "
                             "([N, 4+C, A] decoded, [N, A, 5+C] decoded, [N, A, 5+C] raw grid cells, or a "
                             "CenterNet heat map with wh= and offset= maps)")
        return str(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{where}: {task} argument {key}={value!r} must be a number") from None
    if not math.isfinite(number) or number < 0:
        raise InputError(f"{where}: {task} argument {key}={value!r} must be a finite number >= 0")
    if key in ("input_h", "input_w"):
        if number != int(number) or not 32 <= number <= 16384 or int(number) % 32:
            raise InputError(f"{where}: detection {key}={value!r} must be the input's size in pixels, a multiple "
                             "of 32 between 32 and 16384")
        return int(number)
    if key == "min_area":  # pixels, not a fraction
        if number > 1 << 24:
            raise InputError(f"{where}: segmentation min_area={value!r} is a number of pixels, at most {1 << 24}")
        return number
    if key in ("blank", "top_k"):
        if number != int(number) or (key == "top_k" and not 1 <= number <= 1000):
            raise InputError(f"{where}: {task} {key}={value!r} must be "
                             + ("a class index" if key == "blank" else "a whole number of peaks, 1 to 1000"))
        return int(number)
    if key.startswith(("min_", "max_")) and number > 1:
        raise InputError(f"{where}: {task} argument {key}={value!r} is a fraction between 0 and 1")
    return number


def parse_task_args(task: str, text: str | None, where: str = "--task-args") -> dict[str, Any]:
    """``'format=yolov8,score=0.25'`` -> validated arguments of ``task``."""
    out: dict[str, Any] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise InputError(f"{where}: {part.strip()!r} is not key=value (e.g. 'score=0.25,iou=0.5')")
        out[key.strip()] = _coerce(task, key.strip(), value.strip(), where)
    return out


def parse_tasks(text: str, task_args: str | None, where: str = "--task") -> list[tuple[str, dict[str, Any]]]:
    """``NAME`` or a list ``NAME:k=v,...;NAME:k=v,...`` (a model whose outputs serve several tasks: each task after
    the first names its output) -> [(task, validated arguments)]; ``task_args`` (--task-args) go to the first.
    A task declared as probabilities decides at 0.5 unless it gives its own threshold."""
    parts = [p.strip() for p in text.split(";") if p.strip()]
    if not parts or len(parts) > MAX_TASKS:
        raise InputError(f"{where}: {text!r} is not a task or a list of 1 to {MAX_TASKS} tasks "
                         "(e.g. 'classification:output=prob;keypoints:output=landmarks,boxes=box')")
    out: list[tuple[str, dict[str, Any]]] = []
    for i, part in enumerate(parts):
        name, _, inline = part.partition(":")
        task = canonical_task(name, where)
        args = parse_task_args(task, inline, where)
        if i == 0 and task_args:
            args.update(parse_task_args(task, task_args))
        if i and "output" not in args:
            raise InputError(f"{where}: task {i + 1} of the list ({task}) reads another output: name it "
                             f"({task}:output=NAME)")
        if name.strip().lower() in ("probabilities", "probability") and "threshold" not in args:
            args["threshold"] = 0.5
        out.append((task, args))
    return out


def task_file(model: Path) -> Path:
    return model.with_suffix(".task.yaml")


def load_task_file(path: Path) -> tuple[str, dict[str, Any]]:
    """``MODEL.task.yaml``: ``task: NAME``, optional ``output: NAME`` and ``args: {k: v}``; unknown keys are errors."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")[:65536])
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise InputError(f"{path}: not a readable task file ({str(exc).splitlines()[0]})") from exc
    if not isinstance(data, dict) or "task" not in data:
        raise InputError(f"{path}: a task file is a mapping with a 'task' key (e.g. 'task: ctc')")
    unknown = sorted(set(data) - {"task", "args", "output"})
    if unknown:
        raise InputError(f"{path}: unknown key {unknown[0]!r} (keys: task, output, args)")
    task = canonical_task(str(data["task"]), str(path))
    raw = data.get("args") or {}
    if not isinstance(raw, dict):
        raise InputError(f"{path}: 'args' must be a mapping of argument -> value")
    args = {str(k): _coerce(task, str(k), v, str(path)) for k, v in raw.items()}
    if "output" in data:
        args["output"] = str(data["output"])
    return task, args


def _shape(spec: TensorSpec) -> str:
    return "[" + ", ".join("N" if i == spec.batch_axis else "?" if d == -1 else str(d)
                           for i, d in enumerate(spec.shape)) + "]"


def _rows_are_distributions(v: np.ndarray) -> bool:
    """Every row along the last axis a probability distribution (softmax), or its log (log-softmax)."""
    if v.size == 0 or v.shape[-1] < 2:
        return False
    if v.min() >= -1e-6 and v.max() <= 1 + 1e-6:
        return bool(np.allclose(v.sum(axis=-1), 1.0, atol=1e-3))
    if v.max() <= 1e-6:
        return bool(np.allclose(np.exp(v).sum(axis=-1), 1.0, atol=1e-3))
    return False


def _probability_output(outputs: tuple[TensorSpec, ...], every: list[Outputs] | None) -> int | None:
    """The index of the one output whose fp32 answers are probability rows (each sample a vector in [0, 1] summing
    to 1), when exactly one of several is; else None."""
    if every is None or len(outputs) < 2:
        return None
    found = []
    for i, out in enumerate(every):
        v = [np.asarray(x, np.float64) for x in samples(out)[:64]]
        v = [x.reshape([d for d in x.shape if d != 1]) for x in v]
        if v and all(x.ndim == 1 and _rows_are_distributions(x) and x.min() >= -1e-6 for x in v):
            found.append(i)
    return found[0] if len(found) == 1 else None


def _per_sample_shapes(outputs: tuple[TensorSpec, ...]) -> dict[str, tuple[int, ...]]:
    """Each output's shape without its batch axis (a fixed batch of 1: without that leading 1)."""
    drop = {o.name: 0 if o.batch_axis is None and o.shape[:1] == (1,) else o.batch_axis for o in outputs}
    return {o.name: tuple(d for i, d in enumerate(o.shape) if i != drop[o.name]) for o in outputs}


def _centernet(outputs: tuple[TensorSpec, ...], every: list[Outputs] | None) -> TaskSpec | None:
    """Detection format centernet when the outputs are a CenterNet head (judge.detection.centernet_roles)."""
    shapes = _per_sample_shapes(outputs)
    values = None if every is None else {o.name: samples(v)[:64] for o, v in zip(outputs, every, strict=True)}
    found = centernet_roles(shapes, values)
    if found is None:
        return None
    roles, sure, what = found
    how = "sure" if sure else "UNSURE: a guess never gates int8"
    fmt = roles.get("format", "centernet")
    args = {"format": fmt, **{k: v for k, v in roles.items() if k not in ("heat", "format", "other_format")}}
    named = ",".join(f"{k}={v}" for k, v in args.items() if k != "format")
    hint = " or ".join(f"--task 'detection:format={f},output={roles['heat']},{named}'"
                       for f in (fmt, roles.get("other_format")) if f)
    note = (f"task detection ({what}), inferred from the outputs' shapes{' and fp32 values' if values else ''} "
            f"[{how}]; " + ("declare another with --task" if sure else f"declare it with --task (e.g. {hint})"))
    return TaskSpec("detection", roles["heat"], args, "inferred", note, sure)


def infer_task(outputs: tuple[TensorSpec, ...], values: Outputs | None = None,
               every: list[Outputs] | None = None) -> TaskSpec:
    """The task the first output serves, read from its shape (symbolic dimensions included) and, given ``values``
    (the FP32 outputs on the evaluation data), from what it holds; a CenterNet head (heat map, sizes, offsets and
    landmarks on one grid) from every output's shape and, given ``every`` (fp32's values of each output), theirs.
    The result says how sure it is: ``sure`` only when shape and values agree (softmax rows, boxes with scores in
    [0, 1], ...); a guess never gates int8."""
    head = _centernet(outputs, every) if len(outputs) >= 3 else None
    if head is not None:
        return head
    pick = _probability_output(outputs, every)
    if pick:  # another output than the first holds the answers' probabilities (MTCNN's ONet: box, landmarks, softmax)
        found = infer_task((outputs[pick],), every[pick]) if every is not None else None
        if found is not None and found.name == "classification":
            rest = [o.name for i, o in enumerate(outputs) if i != pick]
            note = found.note.replace("inferred from output", f"inferred from the one of {len(outputs)} outputs "
                                      "holding probabilities, output", 1) + (
                f"; not judged: {', '.join(map(repr, rest))} (under auto an int8 engine that moves any of them "
                "more than 1% does not ship; declare their tasks with a --task list)")
            return TaskSpec(found.name, found.output, found.args, found.source, note, found.sure)
    spec = outputs[0]
    dims = list(spec.shape)
    v = [np.asarray(x, np.float64) for x in samples(values)][:64] if values is not None else None
    whole = v is not None and len({x.shape for x in v}) == 1 and v[0].ndim == len(dims) and (
        spec.batch_axis is None or dims[spec.batch_axis] != -1 or v[0].shape[spec.batch_axis] != 1)
    if whole:  # each sample holds the whole declared shape (a [T, 1, C] recognizer run one sample per call)
        pass
    elif spec.batch_axis is not None and spec.batch_axis < len(dims):
        dims.pop(spec.batch_axis)
    elif dims and dims[0] == 1:
        dims = dims[1:]
    if v is not None and len({x.shape for x in v}) == 1 and v[0].ndim == len(dims):
        dims = [d if d != -1 else n for d, n in zip(dims, v[0].shape, strict=True)]
    core = [d for d in dims if d != 1]  # [T, 1, C] is a sequence, [1, 1, 96] a vector
    keep = [i for i, d in enumerate(dims) if d != 1]
    if v is not None:
        v = [x.reshape([x.shape[i] for i in keep]) if x.ndim == len(dims) else x for x in v]
        if any(x.ndim != len(core) for x in v):
            v = None
    why = f"output {spec.name!r} {_shape(spec)}"
    seen = " and its fp32 values" if v is not None else ""
    sure = v is not None
    args: dict[str, Any] = {}
    if len(dims) == 3 and dims[0] == 1 and all(d == -1 or d >= 8 for d in dims[1:]):
        task, what = "segmentation", "a one-channel map per pixel (a mask or text-region probability)"
    elif not core:
        task, what = "regression", "one value per sample: probabilities / regression"
    elif len(core) == 1:
        if v is not None and all(_rows_are_distributions(x) for x in v):
            task, what = "classification", "class probabilities (each sample's scores sum to 1)"
        elif v is not None and all(_in_unit(x) for x in v):
            task, what = "regression", "independent probabilities in [0, 1] (multi-label): decisions at 0.5"
        else:
            task, what, sure = ("classification" if core[0] != -1 and core[0] <= 1000 else "embedding",
                                "unnormalised scores: class logits or an embedding, which the values cannot tell "
                                "apart", False)
    elif len(core) == 2 and (det := detection_layout(core, v)) is not None:
        task, (fmt, sure, what) = "detection", det
        args = {"format": fmt}
    elif len(core) == 2 and v is not None and all(_rows_are_distributions(x) for x in v) and core[1] >= 3:
        task, what = "ctc", "a class distribution per step (each step's scores sum to 1)"
        if len(dims) != len(core):
            what += f"; the size-1 axis of {_shape(spec)} is dropped"
    elif len(core) == 2 and v is not None and all(_in_unit(x) for x in v):
        task, what = "regression", "independent probabilities in [0, 1] per step (multi-label frames): decisions at 0.5"
    elif len(core) == 2:
        task, what, sure = "ctc", "a sequence of scores per step, not distributions", False
    elif len(core) == 3 and all(d == -1 or d >= 8 for d in core[1:]):
        task, what = "segmentation", "a dense map per pixel"
        sure = v is not None and (all(_in_unit(x) for x in v) or core[0] > 1)
    else:
        task, what, sure = "embedding", "a tensor compared by cosine", False
    how = "sure" if sure else "UNSURE: a guess never gates int8"
    note = (f"task {task} ({what}), inferred from {why}{seen} [{how}]; "
            + ("declare another with --task" if sure else f"declare it with --task (e.g. --task {task})"))
    return TaskSpec(task, spec.name, args, "inferred", note, sure)


def resolve_task(declared: str | None, task_args: str | None, model: Path,
                 outputs: tuple[TensorSpec, ...]) -> TaskSpec:
    """--task (with --task-args), else MODEL.task.yaml, else inferred from the output shapes."""
    if declared:
        (task, args), *more = parse_tasks(declared, task_args)
        source, note = "declared", f"task {task} (--task)"
        if more:
            args["also"] = ";".join(f"{t}:" + ",".join(f"{k}={v}" for k, v in a.items()) for t, a in more)
    elif task_args:
        raise InputError("--task-args needs --task NAME")
    elif task_file(model).is_file():
        task, args = load_task_file(task_file(model))
        source, note = "file", f"task {task} ({task_file(model).name})"
    else:
        return infer_task(outputs)
    names = [o.name for o in outputs]
    if task == "detection" and args.get("format") in ("centernet", "centerface") and "wh" not in args:
        # the roles from the shapes
        roles = centernet_roles(_per_sample_shapes(outputs), None)
        if roles is None or ("output" in args and roles[0]["heat"] != args["output"]):
            raise InputError("detection format centernet: the outputs do not show which map is which; name them "
                             "(--task 'detection:format=centernet,output=HEAT,wh=SIZES,offset=OFFSETS,landmarks=...')")
        args = {**{k: v for k, v in roles[0].items() if k not in ("heat", "format")}, "output": roles[0]["heat"],
                **args}
    output = str(args.pop("output", args.get("scores", names[0])))
    if output not in names:
        raise InputError(f"task {task}: output {output!r} is not one of the model's outputs {names}")
    spec = next(o for o in outputs if o.name == output)
    found = TaskSpec(task, output, args, source, f"{note} on output {output!r} {_shape(spec)}")
    unknown = [o for o in found.reads() if o not in names]
    if unknown:
        raise InputError(f"task {task}: output {unknown[0]!r} is not one of the model's outputs {names}")
    if found.also():
        found = TaskSpec(task, output, args, source, found.note + "; also " + "; ".join(
            f"{t.name} on output {t.output!r}" for t in found.also()))
    return found


# -- judging ---------------------------------------------------------------------------------------
def _classification(task: TaskSpec, ref: list[np.ndarray], cand: list[np.ndarray],
                    min_agreement: float) -> tuple[list[TaskCriterion], dict[str, float]]:
    agree = [float((r.argmax(axis=-1) == c.argmax(axis=-1)).mean()) for r, c in zip(ref, cand, strict=True)]
    whole = sum(a == 1.0 for a in agree)
    bound = task.arg("min_top1")
    crit = _crit("top1_agreement", float(np.mean(agree)), min_agreement if bound is None else bound, "min",
                 _wilson(whole, len(agree)) if all(r.ndim == 1 for r in ref) else _mean_ci(agree))
    return [crit], {}


def ctc_decode(scores: np.ndarray, blank: int = 0) -> list[int]:
    """Greedy CTC: arg-max per step, collapse repeats, drop the blank. ``scores`` is [T, C]."""
    best = scores.reshape(-1, scores.shape[-1]).argmax(axis=-1)
    out: list[int] = []
    prev = -1
    for k in best.tolist():
        if k != prev and k != blank:
            out.append(k)
        prev = k
    return out


def edit_distance(a: list[int], b: list[int]) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


def _ctc(task: TaskSpec, ref: list[np.ndarray], cand: list[np.ndarray],
         _min: float) -> tuple[list[TaskCriterion], dict[str, float]]:
    blank = task.arg("blank")
    exact = edits = chars = 0
    cers: list[float] = []
    for r, c in zip(ref, cand, strict=True):
        if r.ndim == 3 and 1 in r.shape[:2] and c.shape == r.shape:  # batch 1: [1, T, C] or time-major [T, 1, C]
            r, c = r.reshape(-1, r.shape[-1]), c.reshape(-1, c.shape[-1])
        if r.ndim != 2:
            raise InputError(f"ctc needs class scores per step: an output of [N, T, C], or time-major [T, N, C] "
                             f"([1, T, C] or [T, 1, C] for a model that takes one sample per call); a sample here has "
                             f"shape {list(r.shape)}, neither: declare the task this output is for with --task")
        if not 0 <= blank < r.shape[-1]:
            raise InputError(f"ctc blank={blank} is outside the {r.shape[-1]} classes of the output")
        a, b = ctc_decode(r, blank), ctc_decode(c, blank)
        exact += a == b
        d = edit_distance(a, b)
        edits += d
        chars += len(a)
        cers.append(d / max(len(a), 1))
    n = len(ref)
    cer = edits / chars if chars else float(edits > 0)
    crits = [_crit("exact_string_agreement", exact / n, task.arg("min_exact"), "min", _wilson(exact, n)),
             _crit("char_error_rate", cer, task.arg("max_cer"), "max", _mean_ci(cers))]
    return crits, {"strings": float(n), "fp32_chars": float(chars)}


_JUDGES = {"classification": _classification, "ctc": _ctc, "segmentation": segmentation, "regression": regression,
           "embedding": embedding}


def _stack(out: Outputs) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in samples(out)])


def relative_l2(ref: Outputs, cand: Outputs) -> float:
    """||candidate - fp32|| / ||fp32|| over the evaluation set (1.0 when the shapes differ)."""
    r, c = samples(ref), samples(cand)
    if len(r) != len(c) or any(np.shape(a) != np.shape(b) for a, b in zip(r, c, strict=True)):
        return 1.0
    a, b = _stack(ref), _stack(cand)
    norm = float(np.linalg.norm(a))
    return float(np.linalg.norm(a - b)) / norm if norm > 0 else float(np.abs(b).max(initial=0.0) > 0)


def _one(task: TaskSpec, ref: Outputs, cand: Outputs, min_agreement: float,
         others: dict[str, tuple[list[np.ndarray], list[np.ndarray]]]) -> tuple[list[TaskCriterion], dict[str, float]]:
    r, c = samples(ref), samples(cand)
    if len(r) != len(c) or not r:
        raise InputError(f"output {task.output!r}: fp32 gave {len(r)} samples, the candidate {len(c)}")
    if task.name in ("detection", "keypoints"):
        return (detection if task.name == "detection" else keypoints)(task, r, c, min_agreement, others)
    return _JUDGES[task.name](task, r, c, min_agreement)


def judge(task: TaskSpec, ref: Outputs, cand: Outputs, min_agreement: float,
          others: dict[str, tuple[Outputs, Outputs]] | None = None,
          max_unjudged_change: float | None = None) -> TaskReport:
    """Judge the candidate's output against FP32's by the task, and each task of its --task list on its own output
    (their criteria named ``OUTPUT.criterion``); the first criterion is the task's metric. ``others``: every output
    of the model by name, (fp32's, the candidate's). Each output no task reads is measured (relative L2 against
    fp32, in the details); with ``max_unjudged_change``, one that changes more fails ``unjudged_outputs_unchanged``
    (nothing judges what its change does to the answers)."""
    every = {k: (samples(a), samples(b)) for k, (a, b) in (others or {}).items()}
    crits, details = _one(task, ref, cand, min_agreement, every)
    for t in task.also():
        if t.output not in every:
            raise InputError(f"task {t.name}: output {t.output!r} is not one of the model's outputs {sorted(every)}")
        more, extra = _one(t, *every[t.output], min_agreement, every)
        crits += [x.model_copy(update={"name": f"{t.output}.{x.name}"[:64]}) for x in more]
        details.update({f"{t.output}.{k}": v for k, v in extra.items()})
    unjudged = [k for k in every if k not in task.reads()]
    changes = {k: relative_l2(*every[k]) for k in unjudged}
    details.update({f"unjudged_rel_l2.{k}": v for k, v in changes.items()})
    if unjudged and max_unjudged_change is not None:
        same = sum(v <= max_unjudged_change for v in changes.values())
        crits.append(crit("unjudged_outputs_unchanged", same / len(unjudged), 1.0, "min", None))
        details["max_unjudged_rel_l2"] = float(max_unjudged_change)
    first = crits[0]
    note = task.note + "".join(f"; keypoints {t.output!r}: layout {choose_layout(t, every[t.output][0], every)[2]}"
                               for t in (task, *task.also()) if t.name == "keypoints" and "layout" not in t.args
                               and t.output in every)
    return TaskReport(task=task.name, source=task.source, output=task.output,  # type: ignore[arg-type]
                      args={k: str(v) for k, v in task.args.items()}, note=note[:2000], metric=first.name,
                      value=first.value, ci95=first.ci95, criteria=tuple(crits), passed=all(x.passed for x in crits),
                      details={k: round(v, 6) for k, v in details.items()})
