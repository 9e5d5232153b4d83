"""What a model is for, and how a built engine is judged against FP32 by that task.

Comparing tensors does not say whether a model still does its job: a detector's argmax over anchors
means nothing, per-step agreement of an OCR recognizer hides changed strings, and cosine on an
``[N, 1]`` probability is always 1. So the gate judges the task:

=================  ==========================================================================
task               criteria (each with a bound; the gate passes when all hold)
=================  ==========================================================================
classification     top-1 agreement with FP32 (per sample)
detection          FP32's boxes (score >= ``score``, NMS) matched by IoU >= ``iou`` with the same
                   class: recall and precision of FP32's boxes, mean IoU of the matches
ctc                greedy CTC decoding (arg-max, collapse repeats, drop ``blank``): exact-string
                   agreement and character error rate against FP32's strings
segmentation       mask IoU per sample (one channel: ``> threshold``; several: arg-max per pixel); one channel:
                   the objects too (connected components of at least ``min_area`` pixels, a text detector's
                   boxes): FP32's matched at IoU 0.5, recall and precision (``min_instances``)
regression         decision agreement at ``threshold`` (probabilities: 0.5 by default); without a
                   threshold, the share of samples within ``tol`` of FP32; max and mean abs error. With
                   ``min_segments`` (a VAD): the evaluation samples in order are one stream, its decisions
                   runs of positives (segments, merged across samples): FP32's matched one to one at
                   interval IoU >= 0.5, recall and precision
embedding          neighbour rank: each candidate embedding's nearest FP32 embedding among the evaluation set's
                   is its own (``min_retrieval``); the 5th-percentile cosine with FP32 (``min_cosine``)
=================  ==========================================================================

The task is declared (``--task NAME --task-args 'k=v,...'``), read from ``MODEL.task.yaml`` beside the
model, or inferred from the first output's shape (the inference says so). Pure functions of arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgefleet.judge.errors import InputError
from edgefleet.protocol.manifest import TaskCriterion, TaskReport, TensorSpec

__all__ = ["TASKS", "Outputs", "TaskSpec", "canonical_task", "infer_task", "judge", "load_task_file", "parse_task_args",
           "resolve_task", "samples"]

# an output over the evaluation set: samples on axis 0, or one array per sample when their shapes differ
Outputs = np.ndarray | list[np.ndarray]

ALIASES = {"sequence": "ctc", "probabilities": "regression", "mask": "segmentation", "masks": "segmentation"}
# task -> its arguments and their defaults (None: chosen from the data or from --min-agreement)
TASKS: dict[str, dict[str, Any]] = {
    "classification": {"min_top1": None},
    "detection": {"format": "yolov8", "score": 0.25, "iou": 0.5, "nms": 0.7, "min_recall": 0.98,
                  "min_precision": 0.98, "min_iou": 0.8, "input_h": None, "input_w": None},
    "ctc": {"blank": 0, "min_exact": 0.98, "max_cer": 0.02},  # at most 2% of the strings change
    "segmentation": {"threshold": None, "min_iou": 0.9, "min_instances": 0.98, "min_area": 10},
    "regression": {"threshold": None, "min_decision": None, "tol": None, "min_within": 0.99, "min_segments": None},
    "embedding": {"min_cosine": None, "min_retrieval": 0.98},
}
# yolov8: [4+C, A] decoded boxes (cx, cy, w, h) and class scores; yolov5: [A, 5+C] decoded boxes, objectness and
# class scores; yolox: [A, 5+C] raw grid cells (x, y offsets and log w, log h per cell of the stride-8, 16 and 32
# grids, objectness and class scores), decoded here against the grid of an input_h x input_w image (default: the
# square image whose three grids hold A cells)
DETECTION_FORMATS = ("yolov8", "yolov5", "yolox")
YOLOX_STRIDES = (8, 16, 32)
MAX_ANCHORS = 1 << 20  # work bound on one sample's candidate boxes
# the bound --min-agreement sets, per task, when --task-args does not set it
PRIMARY_BOUND = {"classification": "min_top1", "detection": "min_recall", "ctc": "min_exact",
                 "segmentation": "min_iou", "regression": "min_decision", "embedding": "min_cosine"}


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
    if key == "output":
        return str(value)
    if key not in TASKS[task]:
        raise InputError(f"{where}: {task} takes no argument {key!r}; it takes "
                         f"{', '.join(['output', *TASKS[task]])}")
    if key == "format":
        if str(value) not in DETECTION_FORMATS:
            raise InputError(f"{where}: detection format {value!r} is not one of {', '.join(DETECTION_FORMATS)} "
                             "([N, 4+C, A] decoded, [N, A, 5+C] decoded, or [N, A, 5+C] raw grid cells)")
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
    if key == "blank":
        if number != int(number):
            raise InputError(f"{where}: ctc blank={value!r} must be a class index")
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


def _in_unit(v: np.ndarray) -> bool:
    return bool(v.size and v.min() >= 0 and v.max() <= 1)


def _looks_like_boxes(xywh: np.ndarray, scores: np.ndarray) -> bool:
    """[A, 4] decoded (cx, cy, w, h) in pixels and [A, C] scores in [0, 1]: the boxes whose scores stand out have
    positive sizes and lie within a few image sizes of the origin."""
    if not _in_unit(scores) or xywh.shape[1] != 4 or not len(xywh):
        return False
    best = scores.max(axis=1) >= min(0.25, float(scores.max()))
    box = xywh[best]
    return bool((box[:, 2:] > 0).all() and xywh.max() > 2.0 and np.abs(box[:, :2]).max() < 1e5)


def _detection_layout(dims: list[int], v: list[np.ndarray] | None) -> tuple[str, bool, str] | None:
    """(format, sure, what) when a sample of shape ``dims`` can be a detector's boxes, else None."""
    a, b = dims
    if 5 <= a <= 1024 and (b == -1 or b > 2 * a):  # [4+C, A]
        if v is None:
            return "yolov8", False, f"[4+C, anchors] by its shape alone{' (anchors symbolic)' if b == -1 else ''}"
        ok = all(_looks_like_boxes(x[:4].T, x[4:].T) for x in v)
        return ("yolov8", True, "[4+C, anchors]: 4 box coordinates in pixels and class scores in [0, 1] per anchor"
                ) if ok else None
    if 6 <= b <= 1024 and (a == -1 or a > 2 * b):  # [A, 5+C]
        if v is None:
            return "yolov5", False, "[anchors, 5+C] by its shape alone"
        if not all(_in_unit(x[:, 4:]) for x in v):
            return None
        if all(_looks_like_boxes(x[:, :4], x[:, 4:]) for x in v) and all(x[:, 2:4].min() >= 0 for x in v):
            return "yolov5", True, "[anchors, 5+C]: decoded boxes in pixels, objectness and class scores in [0, 1]"
        if yolox_grid(len(v[0])) is not None:
            return "yolox", True, ("[cells, 5+C] raw grid cells of a YOLOX head (offsets and log sizes, objectness "
                                   f"and class scores in [0, 1]; {len(v[0])} cells = the stride-8/16/32 grids)")
    return None


def infer_task(outputs: tuple[TensorSpec, ...], values: Outputs | None = None) -> TaskSpec:
    """The task the first output serves, read from its shape (symbolic dimensions included) and, given ``values``
    (the FP32 outputs on the evaluation data), from what it holds. The result says how sure it is: ``sure`` only
    when shape and values agree (softmax rows, boxes with scores in [0, 1], ...); a guess never gates int8."""
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
    elif len(core) == 2 and (det := _detection_layout(core, v)) is not None:
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
        task = canonical_task(declared, "--task")
        args, source, note = parse_task_args(task, task_args), "declared", f"task {task} (--task)"
    elif task_args:
        raise InputError("--task-args needs --task NAME")
    elif task_file(model).is_file():
        task, args = load_task_file(task_file(model))
        source, note = "file", f"task {task} ({task_file(model).name})"
    else:
        return infer_task(outputs)
    names = [o.name for o in outputs]
    output = str(args.pop("output", names[0]))
    if output not in names:
        raise InputError(f"task {task}: output {output!r} is not one of the model's outputs {names}")
    spec = next(o for o in outputs if o.name == output)
    return TaskSpec(task, output, args, source, f"{note} on output {output!r} {_shape(spec)}")


# -- judging ---------------------------------------------------------------------------------------
def samples(out: Outputs) -> list[np.ndarray]:
    return list(out) if isinstance(out, list) else [out[i] for i in range(len(out))]


def _wilson(hits: int, n: int) -> tuple[float, float] | None:
    if n == 0:
        return None
    p, z = hits / n, 1.96
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (round(max(0.0, mid - half), 6), round(min(1.0, mid + half), 6))


def _mean_ci(values: list[float]) -> tuple[float, float] | None:
    if not values:
        return None
    v = np.asarray(values, np.float64)
    half = 1.96 * float(v.std(ddof=1)) / math.sqrt(len(v)) if len(v) > 1 else 0.0
    m = float(v.mean())
    return (round(max(0.0, m - half), 6), round(min(1.0, m + half), 6))


def _crit(name: str, value: float, bound: float, kind: str, ci: tuple[float, float] | None) -> TaskCriterion:
    value, bound = round(min(max(value, 0.0), 1.0), 6), round(bound, 6)
    ok = value >= bound - 1e-9 if kind == "min" else value <= bound + 1e-9
    return TaskCriterion(name=name, value=value, bound=bound, kind=kind, ci95=ci, passed=ok)  # type: ignore[arg-type]


def _classification(task: TaskSpec, ref: list[np.ndarray], cand: list[np.ndarray],
                    min_agreement: float) -> tuple[list[TaskCriterion], dict[str, float]]:
    agree = [float((r.argmax(axis=-1) == c.argmax(axis=-1)).mean()) for r, c in zip(ref, cand, strict=True)]
    whole = sum(a == 1.0 for a in agree)
    bound = task.arg("min_top1")
    crit = _crit("top1_agreement", float(np.mean(agree)), min_agreement if bound is None else bound, "min",
                 _wilson(whole, len(agree)) if all(r.ndim == 1 for r in ref) else _mean_ci(agree))
    return [crit], {}


def yolox_grid(anchors: int, input_h: int | None = None,
               input_w: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """The cell offsets [A, 2] (x, y) and strides [A] of YOLOX's stride-8/16/32 grids holding ``anchors`` cells for
    an input_h x input_w image (default: the square image that fits), or None when no such image exists."""
    if input_h is None or input_w is None:
        # a square image of side S holds S*S * (1/64 + 1/256 + 1/1024) = S*S * 21/1024 cells
        side = math.isqrt(anchors * 1024 // 21) if anchors > 0 else 0
        if side < 32 or side % 32:
            return None
        input_h = input_w = side
    levels = [(input_h // s, input_w // s, s) for s in YOLOX_STRIDES]
    if sum(h * w for h, w, _ in levels) != anchors:
        return None
    xy, st = [], []
    for h, w, s in levels:
        gy, gx = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        xy.append(np.stack([gx.reshape(-1), gy.reshape(-1)], axis=1))
        st.append(np.full(h * w, s))
    return np.concatenate(xy).astype(np.float64), np.concatenate(st).astype(np.float64)


def _probabilities(v: np.ndarray) -> np.ndarray:
    """Scores as probabilities: logits (any value outside [0, 1]) through a sigmoid."""
    return v if v.size == 0 or (v.min() >= 0 and v.max() <= 1) else 1 / (1 + np.exp(-np.clip(v, -60, 60)))


def _boxes(x: np.ndarray, fmt: str, score: float, nms: float, input_h: int | None = None,
           input_w: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(xyxy [K, 4], scores [K], classes [K]) after the score threshold and per-class NMS."""
    x = x.astype(np.float64)
    if x.ndim != 2 or x.shape[0] * x.shape[1] > MAX_ANCHORS * 64:
        raise InputError(f"detection ({fmt}) needs one [4+C, A] or [A, 5+C] array per sample of at most "
                         f"{MAX_ANCHORS} boxes; a sample here has shape {list(x.shape)}")
    if fmt == "yolov8":  # [4+C, A]
        rows = x.T
        cls_scores = rows[:, 4:]
    elif fmt == "yolox":  # [A, 5+C] raw cells: decode against the grid
        grid = yolox_grid(len(x), input_h, input_w)
        if grid is None:
            raise InputError(f"detection format yolox: {len(x)} cells are not the stride-8/16/32 grids of a square "
                             "image; give the input size (--task-args 'input_h=H,input_w=W')")
        cells, strides = grid
        rows = np.concatenate([(x[:, :2] + cells) * strides[:, None],
                               np.exp(np.clip(x[:, 2:4], -20, 20)) * strides[:, None], x[:, 4:]], axis=1)
        cls_scores = _probabilities(rows[:, 5:]) * _probabilities(rows[:, 4:5])
    else:  # yolov5: [A, 5+C], objectness times class score
        rows = x
        cls_scores = rows[:, 5:] * rows[:, 4:5]
    if cls_scores.shape[1] == 0:
        raise InputError(f"detection format {fmt}: the output has no class columns ({list(x.shape)})")
    cls = cls_scores.argmax(axis=1)
    sc = cls_scores.max(axis=1)
    keep = sc >= score
    cx, cy, w, h = (rows[keep, i] for i in range(4))
    xyxy = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
    sc, cls = sc[keep], cls[keep]
    order = np.argsort(-sc, kind="stable")[:3000]
    xyxy, sc, cls = xyxy[order], sc[order], cls[order]
    kept: list[int] = []
    suppressed = np.zeros(len(sc), bool)
    for i in range(len(sc)):
        if suppressed[i]:
            continue
        kept.append(i)
        if len(kept) >= 300:
            break
        ious = _iou(xyxy[i], xyxy[i + 1:])
        suppressed[i + 1:] |= (ious > nms) & (cls[i + 1:] == cls[i])
    return xyxy[kept], sc[kept], cls[kept]


def _iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    if len(boxes) == 0:
        return np.zeros(0)
    lt = np.maximum(box[:2], boxes[:, :2])
    rb = np.minimum(box[2:], boxes[:, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=1)
    area = lambda b: np.prod(np.clip(b[..., 2:] - b[..., :2], 0, None), axis=-1)  # noqa: E731
    union = area(box) + area(boxes) - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


# a detector's gate judges the boxes fp32 finds: with fewer than this on the evaluation data, "all kept" says nothing
# (the corpus's YOLOX captcha detector passed at 0 of 0 boxes on data where it finds none)
MIN_REFERENCE_BOXES = 10


def _detection(task: TaskSpec, ref: list[np.ndarray], cand: list[np.ndarray],
               _min: float) -> tuple[list[TaskCriterion], dict[str, float]]:
    fmt, score, iou_t, nms = task.arg("format"), task.arg("score"), task.arg("iou"), task.arg("nms")
    n_ref = n_cand = tp = 0
    ious: list[float] = []
    for r, c in zip(ref, cand, strict=True):
        if r.ndim != 2:
            raise InputError(f"detection ({fmt}) needs an output of [N, 4+C, A] (yolov8) or [N, A, 5+C] (yolov5, "
                             "yolox); "
                             f"a sample here has shape {list(r.shape)}: declare another task with --task")
        rb, _, rc = _boxes(r, fmt, score, nms, task.arg("input_h"), task.arg("input_w"))
        cb, _, cc = _boxes(c, fmt, score, nms, task.arg("input_h"), task.arg("input_w"))
        used = np.zeros(len(cb), bool)
        for box, k in zip(rb, rc, strict=True):  # reference boxes in order of score
            cand_iou = np.where(~used & (cc == k), _iou(box, cb), 0.0)
            j = int(cand_iou.argmax()) if len(cb) else -1
            if j >= 0 and cand_iou[j] >= iou_t:
                used[j] = True
                tp += 1
                ious.append(float(cand_iou[j]))
        n_ref += len(rb)
        n_cand += len(cb)
    if n_ref < MIN_REFERENCE_BOXES:  # 0 of 0 boxes kept is not evidence: the eval data show no objects
        raise InputError(f"detection ({fmt}): the fp32 model finds {n_ref} box(es) on the {len(ref)} evaluation "
                         f"sample(s) at score >= {score:g}, fewer than the {MIN_REFERENCE_BOXES} a box gate needs to "
                         "judge anything: give evaluation images with the objects the model detects (or check "
                         "--task-args format=, score=)")
    recall = tp / n_ref
    precision = tp / n_cand if n_cand else 1.0
    crits = [_crit("box_recall", recall, task.arg("min_recall"), "min", _wilson(tp, n_ref)),
             _crit("box_precision", precision, task.arg("min_precision"), "min", _wilson(tp, n_cand)),
             _crit("mean_iou", float(np.mean(ious)) if ious else (1.0 if n_ref == 0 else 0.0), task.arg("min_iou"),
                   "min", _mean_ci(ious))]
    return crits, {"fp32_boxes": float(n_ref), "candidate_boxes": float(n_cand), "matched_boxes": float(tp)}


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


def _segmentation(task: TaskSpec, ref: list[np.ndarray], cand: list[np.ndarray],
                  _min: float) -> tuple[list[TaskCriterion], dict[str, float]]:
    thr = task.arg("threshold")
    if thr is None:  # probabilities are cut at 0.5, logits at 0
        lo = min(float(r.min(initial=0.0)) for r in ref)
        hi = max(float(r.max(initial=0.0)) for r in ref)
        thr = 0.5 if lo >= 0 and hi <= 1 else 0.0
    ious: list[float] = []
    n_ref = n_cand = matched = 0
    one_channel = True
    for r, c in zip(ref, cand, strict=True):
        if r.ndim == 3 and r.shape[0] > 1:
            one_channel = False
            rl, cl = r.argmax(axis=0), c.argmax(axis=0)
            per = [(np.sum((rl == k) & (cl == k)), np.sum((rl == k) | (cl == k))) for k in np.union1d(rl, cl)]
            ious.append(float(np.mean([i / u for i, u in per if u])) if per else 1.0)
        else:
            rm, cm = r > thr, c > thr
            union = int((rm | cm).sum())
            ious.append(float((rm & cm).sum() / union) if union else 1.0)
            rb, cb = _instances(rm, task.arg("min_area")), _instances(cm, task.arg("min_area"))
            n_ref, n_cand, matched = n_ref + len(rb), n_cand + len(cb), matched + _match_boxes(rb, cb, 0.5)
    if one_channel and all(bool((r > thr).all()) or not bool((r > thr).any()) for r in ref):
        side = "above" if bool((ref[0] > thr).all()) else "below"
        raise InputError(f"segmentation: every value of fp32's output is {side} the threshold {thr:g} on every sample, "
                         "so its masks are empty or whole and say nothing about an engine; declare the task this "
                         "output is for with --task (or --task-args threshold=T)")
    crits = [_crit("mask_iou", float(np.mean(ious)), task.arg("min_iou"), "min", _mean_ci(ious))]
    details = {"worst_mask_iou": round(min(ious), 6), "threshold": float(thr)}
    if one_channel:  # the objects the map is for (a text detector's lines): FP32's kept, none added
        bound = task.arg("min_instances")
        crits += [_crit("instance_recall", matched / n_ref if n_ref else 1.0, bound, "min", _wilson(matched, n_ref)),
                  _crit("instance_precision", matched / n_cand if n_cand else 1.0, bound, "min",
                        _wilson(matched, n_cand))]
        details.update({"fp32_instances": float(n_ref), "candidate_instances": float(n_cand),
                        "matched_instances": float(matched)})
    return crits, details


MAX_INSTANCES = 10_000  # per map: work bound on matching (a noisy map of single pixels is cut here)


def _instances(mask: np.ndarray, min_area: float) -> np.ndarray:
    """Bounding boxes [K, 4] (x0, y0, x1, y1) of the 4-connected components of a 2-D mask with at least ``min_area``
    pixels (squeezed to 2-D; a map of more dimensions is judged per pixel only)."""
    m = np.squeeze(mask)
    if m.ndim != 2:
        return np.zeros((0, 4))
    try:
        import cv2
    except ImportError as exc:
        raise InputError("judging a segmentation map's objects needs OpenCV: pip install 'edgefleet[image]'") from exc
    _, _, stats, _ = cv2.connectedComponentsWithStats(m.astype(np.uint8), connectivity=4)
    keep = stats[1:][stats[1:, 4] >= min_area][:MAX_INSTANCES]
    return np.stack([keep[:, 0], keep[:, 1], keep[:, 0] + keep[:, 2], keep[:, 1] + keep[:, 3]], axis=1).astype(
        np.float64) if len(keep) else np.zeros((0, 4))


def _match_boxes(ref: np.ndarray, cand: np.ndarray, iou_t: float) -> int:
    """FP32's boxes matched one to one by the candidate's, largest IoU first, at IoU >= ``iou_t``."""
    if not len(ref) or not len(cand):
        return 0
    lt = np.maximum(ref[:, None, :2], cand[None, :, :2])
    rb = np.minimum(ref[:, None, 2:], cand[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=-1)
    area = lambda b: np.prod(b[:, 2:] - b[:, :2], axis=-1)  # noqa: E731
    iou = inter / np.maximum(area(ref)[:, None] + area(cand)[None] - inter, 1e-9)
    used_r, used_c, hits = set(), set(), 0
    for flat in np.argsort(-iou, axis=None):
        i, j = divmod(int(flat), iou.shape[1])
        if iou[i, j] < iou_t:
            break
        if i not in used_r and j not in used_c:
            used_r.add(i)
            used_c.add(j)
            hits += 1
    return hits


def _regression(task: TaskSpec, ref: list[np.ndarray], cand: list[np.ndarray],
                min_agreement: float) -> tuple[list[TaskCriterion], dict[str, float]]:
    r = np.concatenate([x.reshape(-1) for x in ref]).astype(np.float64)
    c = np.concatenate([x.reshape(-1) for x in cand]).astype(np.float64)
    err = np.abs(r - c)
    details = {"max_abs_error": float(err.max(initial=0.0)), "mean_abs_error": float(err.mean()) if err.size else 0.0}
    thr = task.arg("threshold")
    if thr is None and r.size and r.min() >= 0 and r.max() <= 1:
        thr = 0.5  # probabilities
    crits = []
    if thr is not None:
        same = int(((r > thr) == (c > thr)).sum())
        bound = task.arg("min_decision")
        crits.append(_crit("decision_agreement", same / max(r.size, 1), min_agreement if bound is None else bound,
                           "min", _wilson(same, r.size)))
        details["threshold"] = float(thr)
        if task.arg("min_segments") is not None:
            seg_crits, seg_details = _segments(r > thr, c > thr, task.arg("min_segments"))
            crits += seg_crits
            details.update(seg_details)
    elif task.arg("min_segments") is not None:
        raise InputError("regression: min_segments judges the runs of decisions, and this output's values are not "
                         "probabilities: give the decision threshold too (--task-args threshold=T,min_segments=...)")
    if thr is None or "tol" in task.args:
        tol = task.arg("tol")
        if tol is None:
            tol = 0.01 * float(r.max() - r.min()) if r.size else 0.0
        within = sum(float(np.abs(a.astype(np.float64) - b).max(initial=0.0)) <= tol + 1e-12
                     for a, b in zip(ref, cand, strict=True))
        crits.append(_crit("within_tolerance", within / len(ref), task.arg("min_within"), "min",
                           _wilson(within, len(ref))))
        details["tol"] = float(tol)
    return crits, details


def _runs(decisions: np.ndarray) -> np.ndarray:
    """[K, 2]: start and end (exclusive) of each maximal run of True in a 1-D stream of decisions."""
    edges = np.diff(np.concatenate([[0], decisions.astype(np.int8), [0]]))
    return np.stack([np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)], axis=1)


def _segments(ref: np.ndarray, cand: np.ndarray, bound: float) -> tuple[list[TaskCriterion], dict[str, float]]:
    """A VAD's answer is its speech segments: the runs of positive decisions over the stream (the evaluation samples
    in order, so a segment spans as many samples as it lasts). FP32's segments are matched one to one by the
    candidate's, largest overlap first, at interval IoU >= 0.5: a segment split in two, merged with its neighbour,
    cut to less than half or gone is lost; a segment FP32 does not have is added."""
    a, b = _runs(ref), _runs(cand)
    if not len(a):
        raise InputError(f"regression: min_segments judges segments (runs of positive decisions), and fp32 decides "
                         f"no positive on the {len(ref)} values of the evaluation stream: give evaluation data with "
                         "the events the model detects (speech for a VAD), in stream order")
    pairs = []
    j = 0
    for i, (s0, e0) in enumerate(a):  # both lists are sorted and each is disjoint: a sweep finds the overlaps
        while j < len(b) and b[j, 1] <= s0:
            j += 1
        k = j
        while k < len(b) and b[k, 0] < e0:
            inter = min(e0, b[k, 1]) - max(s0, b[k, 0])
            iou = inter / (max(e0, b[k, 1]) - min(s0, b[k, 0]))
            if iou >= 0.5:
                pairs.append((iou, i, k))
            k += 1
    used_a: set[int] = set()
    used_b: set[int] = set()
    for _, i, k in sorted(pairs, reverse=True):
        if i not in used_a and k not in used_b:
            used_a.add(i)
            used_b.add(k)
    hits = len(used_a)
    crits = [_crit("segment_recall", hits / len(a), bound, "min", _wilson(hits, len(a))),
             _crit("segment_precision", hits / len(b) if len(b) else 0.0, bound, "min", _wilson(hits, len(b)))]
    return crits, {"fp32_segments": float(len(a)), "candidate_segments": float(len(b)), "matched_segments": float(hits)}


def _embedding(task: TaskSpec, ref: list[np.ndarray], cand: list[np.ndarray],
               min_agreement: float) -> tuple[list[TaskCriterion], dict[str, float]]:
    """What an embedding is used for is finding its neighbours: each candidate embedding must have its own FP32
    embedding as its nearest among the evaluation set's FP32 embeddings (quantization noise smaller than the gap to
    any other input), and the cosine with FP32 stays high for all but the worst 5% (one outlier does not decide)."""
    shape = ref[0].shape
    if any(r.shape != shape or c.shape != shape for r, c in zip(ref, cand, strict=True)):
        raise InputError(f"embedding: the samples' outputs differ in shape (first {list(shape)}); declare another task")
    x = np.stack([r.reshape(-1) for r in ref]).astype(np.float64)
    y = np.stack([c.reshape(-1) for c in cand]).astype(np.float64)
    nx, ny = np.linalg.norm(x, axis=1), np.linalg.norm(y, axis=1)
    den = nx * ny
    cos = np.where(den > 0, (x * y).sum(axis=1) / np.where(den > 0, den, 1), (np.abs(x - y).max(axis=1) == 0) * 1.0)
    xn, yn = x / np.maximum(nx, 1e-30)[:, None], y / np.maximum(ny, 1e-30)[:, None]
    hits = 0
    for s in range(0, len(x), 1024):  # [1024, N] similarities at a time
        sim = yn[s:s + 1024] @ xn.T
        own = sim[np.arange(len(sim)), np.arange(s, s + len(sim))]
        hits += int((own >= sim.max(axis=1) - 1e-9).sum())  # a tie with an identical input counts as found
    bound = task.arg("min_cosine")
    p05 = float(np.percentile(cos, 5))
    crits = [_crit("neighbour_retrieval", hits / len(x), task.arg("min_retrieval"), "min", _wilson(hits, len(x))),
             _crit("cosine_p05", p05, 0.95 if bound is None else bound, "min", None)]
    return crits, {"mean_cosine": round(float(np.mean(cos)), 6), "worst_cosine": round(float(cos.min()), 6)}


_JUDGES = {"classification": _classification, "detection": _detection, "ctc": _ctc, "segmentation": _segmentation,
           "regression": _regression, "embedding": _embedding}


def judge(task: TaskSpec, ref: Outputs, cand: Outputs, min_agreement: float) -> TaskReport:
    """Judge the candidate's output against FP32's by the task; the first criterion is the task's metric."""
    r, c = samples(ref), samples(cand)
    if len(r) != len(c) or not r:
        raise InputError(f"output {task.output!r}: fp32 gave {len(r)} samples, the candidate {len(c)}")
    crits, details = _JUDGES[task.name](task, r, c, min_agreement)
    first = crits[0]
    return TaskReport(task=task.name, source=task.source, output=task.output,  # type: ignore[arg-type]
                      args={k: str(v) for k, v in task.args.items()}, note=task.note, metric=first.name,
                      value=first.value, ci95=first.ci95, criteria=tuple(crits), passed=all(x.passed for x in crits),
                      details={k: round(v, 6) for k, v in details.items()})
