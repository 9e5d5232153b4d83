"""Detection: a detector's boxes decoded from its outputs (YOLO heads, CenterNet maps) and judged against FP32's.

=============  =================================================================================================
format         outputs (per sample)
=============  =================================================================================================
yolov8         ``[4+C, A]`` decoded boxes (cx, cy, w, h) and class scores
yolov5         ``[A, 5+C]`` decoded boxes, objectness and class scores
yolox          ``[A, 5+C]`` raw grid cells (x, y offsets and log w, log h per cell of the stride-8, 16 and 32 grids,
               objectness and class scores), decoded against the grid of an input_h x input_w image (default: the
               square image whose three grids hold A cells)
centernet      four maps of one H x W grid: the centre heat map ``output`` ``[C, H, W]`` (after a sigmoid or not:
               logits, any value outside [0, 1], go through one), the box size ``wh`` ``[2, H, W]`` and the
               sub-cell ``offset`` ``[2, H, W]`` in grid cells, and optional ``landmarks`` ``[2L, H, W]`` (x, y of
               each of L points from the peak's cell, in grid cells: CenterNet's multi-pose ``hps``). Decoded by
               peak picking: a cell whose score is the largest of its 3x3 neighbourhood and at least ``score``, the
               ``top_k`` best; box = (x + ox, y + oy) -/+ (w, h)/2, in grid cells
centerface     the same maps as CenterFace lays them out: log sizes (h, w), offsets (y, x), box = (x + ox + 0.5,
               y + oy + 0.5) -/+ exp(w, h)/2, landmarks (y, x) per point as shares of the box from its top left
=============  =================================================================================================

A detector whose boxes and scores are separate outputs names them: ``boxes=`` ([A, 4] or [4, A] per sample, each box
``box_format`` xyxy (default) or cxcywh, in pixels) and ``scores=`` (or the task's output: [A, C], [C, A] or [A];
logits through a sigmoid), e.g. ``--task 'detection:boxes=bboxes,scores=scores'``; NMS and the score threshold as
for the formats above.

FP32's boxes are matched one to one by the candidate's of the same class at IoU >= ``iou``: recall (lost boxes),
precision (added boxes), mean IoU of the matches; with landmarks, each matched face's points are judged as
:mod:`judge.keypoints` does (PCK: within ``pck`` of the FP32 box's longer side). Pure functions of arrays.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..protocol.manifest import TaskCriterion
from .criteria import crit, in_unit, mean_ci, wilson
from .errors import InputError

__all__ = ["BOX_FORMATS", "DETECTION_FORMATS", "MIN_REFERENCE_BOXES", "centernet_decode", "detection",
           "detection_layout", "yolox_grid"]

DETECTION_FORMATS = ("yolov8", "yolov5", "yolox", "centernet", "centerface")
BOX_FORMATS = ("xyxy", "cxcywh")  # a separate boxes= output's layout of each box
CENTER_FORMATS = ("centernet", "centerface")
YOLOX_STRIDES = (8, 16, 32)
MAX_ANCHORS = 1 << 20  # work bound on one sample's candidate boxes
MAX_PEAKS = 1000  # work bound on top_k: the peaks of one heat map kept


def _looks_like_boxes(xywh: np.ndarray, scores: np.ndarray) -> bool:
    """[A, 4] decoded (cx, cy, w, h) in pixels and [A, C] scores in [0, 1]: the boxes whose scores stand out have
    positive sizes and lie within a few image sizes of the origin."""
    if not in_unit(scores) or xywh.shape[1] != 4 or not len(xywh):
        return False
    best = scores.max(axis=1) >= min(0.25, float(scores.max()))
    box = xywh[best]
    return bool((box[:, 2:] > 0).all() and xywh.max() > 2.0 and np.abs(box[:, :2]).max() < 1e5)


def detection_layout(dims: list[int], v: list[np.ndarray] | None) -> tuple[str, bool, str] | None:
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
        if not all(in_unit(x[:, 4:]) for x in v):
            return None
        if all(_looks_like_boxes(x[:, :4], x[:, 4:]) for x in v) and all(x[:, 2:4].min() >= 0 for x in v):
            return "yolov5", True, "[anchors, 5+C]: decoded boxes in pixels, objectness and class scores in [0, 1]"
        if yolox_grid(len(v[0])) is not None:
            return "yolox", True, ("[cells, 5+C] raw grid cells of a YOLOX head (offsets and log sizes, objectness "
                                   f"and class scores in [0, 1]; {len(v[0])} cells = the stride-8/16/32 grids)")
    return None


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


def _centernet_maps(task: Any, others: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] | None,
                    ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[list[Any], list[Any]]:
    """Per sample, the (heat, wh, offset, landmarks) maps of fp32 and of the candidate (offset, landmarks: None when
    the task names none)."""
    roles = [task.arg(k) for k in ("wh", "offset", "landmarks")]
    if roles[0] is None:
        raise InputError("detection formats centernet and centerface read the heat map (output=), the box sizes "
                         "(wh=) and the offsets (offset=) and landmarks (landmarks=), if any: name the wh output at "
                         "least, e.g. "
                         "--task 'detection:format=centernet,output=hm,wh=wh,offset=reg,landmarks=lms'")
    got = others or {}
    missing = [r for r in roles if r is not None and r not in got]
    if missing:
        raise InputError(f"detection format centernet: output {missing[0]!r} is not one of the model's outputs "
                         f"{sorted(got)}")
    sides = []
    for k, heat in ((0, ref), (1, cand)):
        maps = [got[r][k] if r is not None else [None] * len(heat) for r in roles]
        sides.append(list(zip(heat, *maps, strict=True)))
    return sides[0], sides[1]


def _separate(task: Any, ref: list[np.ndarray], cand: list[np.ndarray],
              others: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] | None) -> list[Any]:
    """Per sample, fp32's and the candidate's decoded boxes of a detector whose boxes (``boxes=``: [A, 4] or [4, A],
    ``box_format`` xyxy or cxcywh) and class scores (the task's output, or ``scores=``: [A, C], [C, A] or [A]) are
    separate outputs."""
    got = others or {}
    names = [task.arg("boxes"), task.arg("scores") or task.output]
    missing = [n for n in names if n not in got]
    if missing:
        raise InputError(f"detection: output {missing[0]!r} (boxes=/scores=) is not one of the model's outputs "
                         f"{sorted(got)}")
    (rb, cb), (rs, cs) = got[names[0]], got[names[1]]
    out = []
    for i in range(len(ref)):
        pair = []
        for boxes, scores in ((rb[i], rs[i]), (cb[i], cs[i])):
            b = np.asarray(boxes, np.float64).reshape([d for d in np.shape(boxes) if d != 1] or [1])
            b = b.T if b.ndim == 2 and b.shape[0] == 4 and b.shape[1] != 4 else b
            sc = np.asarray(scores, np.float64)
            sc = sc.reshape(-1, 1) if sc.size == len(b) else sc.reshape([d for d in sc.shape if d != 1])
            sc = sc.T if sc.ndim == 2 and sc.shape[0] != len(b) and sc.shape[1] == len(b) else sc
            if b.ndim != 2 or b.shape[1] != 4 or sc.ndim != 2 or len(sc) != len(b):
                raise InputError(f"detection with boxes=: boxes [A, 4] and scores [A, C] per sample, with the same A; "
                                 f"got {list(np.shape(boxes))} and {list(np.shape(scores))}")
            if task.arg("box_format") == "xyxy":
                b = np.concatenate([(b[:, :2] + b[:, 2:]) / 2, b[:, 2:] - b[:, :2]], axis=1)
            pair.append((*_boxes(np.concatenate([b, _probabilities(sc)], axis=1).T, "yolov8", task.arg("score"),
                                 task.arg("nms")), None))
        out.append(tuple(pair))
    return out


def _pool3(p: np.ndarray) -> np.ndarray:
    """3x3 max pool (stride 1, same size) over the last two axes."""
    q = np.pad(p, [(0, 0)] * (p.ndim - 2) + [(1, 1), (1, 1)], constant_values=-np.inf)
    h, w = p.shape[-2:]
    return np.max(np.stack([q[..., i:i + h, j:j + w] for i in range(3) for j in range(3)]), axis=0)


def centernet_decode(heat: np.ndarray, wh: np.ndarray, offset: np.ndarray | None, landmarks: np.ndarray | None,
                     score: float, top_k: int, logits: bool, style: str = "centernet"
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(xyxy [K, 4], scores [K], classes [K], points [K, L, 2] or None), in grid cells, of one sample's maps
    (``style``: centernet or centerface, see the module's table)."""
    heat = np.asarray(heat, np.float64)
    if heat.ndim == 2:
        heat = heat[None]
    if heat.ndim != 3 or np.asarray(wh).shape != (2, *heat.shape[1:]):
        raise InputError(f"detection format centernet needs a heat map [C, H, W] and sizes [2, H, W] per sample on "
                         f"one grid; got {list(heat.shape)} and {list(np.asarray(wh).shape)}")
    p = 1 / (1 + np.exp(-np.clip(heat, -60, 60))) if logits else heat
    peak = (p >= _pool3(p)) & (p >= score)
    flat = np.flatnonzero(peak)
    best = flat[np.argsort(-p.reshape(-1)[flat], kind="stable")[:min(int(top_k), MAX_PEAKS)]]
    c, y, x = np.unravel_index(best, p.shape)
    face = style == "centerface"
    ox, oy = (offset[int(face), y, x], offset[1 - int(face), y, x]) if offset is not None else (0.0, 0.0)
    w, h = (np.exp(np.clip(wh[1, y, x], -20, 20)), np.exp(np.clip(wh[0, y, x], -20, 20))) if face else \
        (wh[0, y, x], wh[1, y, x])
    cx, cy = x + ox + 0.5 * face, y + oy + 0.5 * face
    xyxy = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1).astype(np.float64)
    points = None
    if landmarks is not None:
        lm = np.asarray(landmarks, np.float64)
        if lm.ndim != 3 or lm.shape[0] % 2 or lm.shape[1:] != p.shape[1:]:
            raise InputError(f"detection format centernet: landmarks must be [2L, H, W] on the heat map's grid; "
                             f"got {list(lm.shape)}")
        if face:  # (y, x) shares of the box from its top left
            points = np.stack([lm[1::2, y, x].T * w[:, None] + xyxy[:, :1], lm[0::2, y, x].T * h[:, None]
                               + xyxy[:, 1:2]], axis=-1)
        else:
            points = np.stack([lm[0::2, y, x].T + x[:, None], lm[1::2, y, x].T + y[:, None]], axis=-1)
    return xyxy.reshape(-1, 4), p.reshape(-1)[best], c, points


def detection(task: Any, ref: list[np.ndarray], cand: list[np.ndarray], _min: float,
              others: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] | None = None
              ) -> tuple[list[TaskCriterion], dict[str, float]]:
    """FP32's boxes matched by the candidate's (``task``: a judge.tasks.TaskSpec of task detection)."""
    from .keypoints import pck_criteria, pck_hits

    fmt, score, iou_t, nms = task.arg("format"), task.arg("score"), task.arg("iou"), task.arg("nms")
    n_ref = n_cand = tp = 0
    ious: list[float] = []
    hits: list[np.ndarray] = []
    n_points = 0
    if fmt in CENTER_FORMATS:
        ref_s, cand_s = _centernet_maps(task, others, ref, cand)
        logits = not all(in_unit(np.asarray(r, np.float64)) for r in ref)
        found = [(centernet_decode(r[0], r[1], r[2], r[3], score, task.arg("top_k"), logits, fmt),
                  centernet_decode(c[0], c[1], c[2], c[3], score, task.arg("top_k"), logits, fmt))
                 for r, c in zip(ref_s, cand_s, strict=True)]
    elif task.arg("boxes") is not None:
        found = _separate(task, ref, cand, others)
    else:
        found = []
        for r, c in zip(ref, cand, strict=True):
            if r.ndim != 2:
                raise InputError(f"detection ({fmt}) needs an output of [N, 4+C, A] (yolov8) or [N, A, 5+C] "
                                 f"(yolov5, yolox); a sample here has shape {list(r.shape)}: declare another task "
                                 "with --task")
            found.append(((*_boxes(r, fmt, score, nms, task.arg("input_h"), task.arg("input_w")), None),
                          (*_boxes(c, fmt, score, nms, task.arg("input_h"), task.arg("input_w")), None)))
    for (rb, _, rc, rp), (cb, _, cc, cp) in found:
        used = np.zeros(len(cb), bool)
        for i, (box, k) in enumerate(zip(rb, rc, strict=True)):  # reference boxes in order of score
            cand_iou = np.where(~used & (cc == k), _iou(box, cb), 0.0)
            j = int(cand_iou.argmax()) if len(cb) else -1
            matched = j >= 0 and cand_iou[j] >= iou_t
            if matched:
                used[j] = True
                tp += 1
                ious.append(float(cand_iou[j]))
            if rp is not None:  # a lost face loses its points
                size = float(max(box[2] - box[0], box[3] - box[1]))
                hits.append(pck_hits(rp[i], cp[j] if matched and cp is not None else None, size, task.arg("pck")))
                n_points += len(rp[i])
        n_ref += len(rb)
        n_cand += len(cb)
    if n_ref < MIN_REFERENCE_BOXES:  # 0 of 0 boxes kept is not evidence: the eval data show no objects
        raise InputError(f"detection ({fmt}): the fp32 model finds {n_ref} box(es) on the {len(ref)} evaluation "
                         f"sample(s) at score >= {score:g}, fewer than the {MIN_REFERENCE_BOXES} a box gate needs to "
                         "judge anything: give evaluation images with the objects the model detects (or check "
                         "--task-args format=, score=)")
    recall = tp / n_ref
    precision = tp / n_cand if n_cand else 1.0
    crits = [crit("box_recall", recall, task.arg("min_recall"), "min", wilson(tp, n_ref)),
             crit("box_precision", precision, task.arg("min_precision"), "min", wilson(tp, n_cand)),
             crit("mean_iou", float(np.mean(ious)) if ious else (1.0 if n_ref == 0 else 0.0), task.arg("min_iou"),
                  "min", mean_ci(ious))]
    details = {"fp32_boxes": float(n_ref), "candidate_boxes": float(n_cand), "matched_boxes": float(tp)}
    if hits:
        more, extra = pck_criteria(hits, task.arg("min_pck"), task.arg("pck"), "box_longer_side")
        crits += more
        details.update(extra)
    return crits, details


_ROLE_NAMES = {"heat": ("hm", "heat", "center", "centre", "score", "cls"), "wh": ("wh", "size", "scale"),
               "offset": ("off", "reg"), "landmarks": ("lm", "landmark", "kp", "hps", "point", "pts")}


def _named(name: str, role: str) -> bool:
    low = name.lower()
    return any(h in low for h in _ROLE_NAMES[role])


def centernet_roles(shapes: dict[str, tuple[int, ...]], values: dict[str, list[np.ndarray]] | None
                    ) -> tuple[dict[str, str], bool, str] | None:
    """A CenterNet head among a model's outputs: ``shapes`` (each output's per-sample shape, -1 symbolic) and, when
    known, fp32's ``values``. Returns ({role: output}, sure, what) or None. The maps share one H x W grid: the heat
    map has 1..C channels, the sizes and the offsets 2 each, landmarks 2L (10 for five face points). The shapes
    cannot tell sizes from offsets: the names do (wh/size, off/reg), or the values (offsets within a cell, sizes of
    several cells). Sure only when the values agree: a heat map with peaks, offsets within a cell of their own
    (-1..2), sizes above 0.5, and the sizes' layout (linear or CenterFace's log sizes) told (:func:`_size_layout`);
    when it cannot be, the result is not sure and ``roles["other_format"]`` names the other candidate."""
    maps = {k: s for k, s in shapes.items() if len(s) == 3}
    grids = {s[1:] for s in maps.values()}
    if len(maps) < 3 or len(grids) != 1 or any(d != -1 and d < 4 for d in next(iter(grids))):
        return None
    two = [k for k, s in maps.items() if s[0] == 2]
    rest = [k for k in maps if k not in two]
    lms = [k for k in rest if maps[k][0] >= 4 and maps[k][0] % 2 == 0 and (_named(k, "landmarks") or maps[k][0] == 10)]
    heat = [k for k in rest if k not in lms]
    if len(heat) != 1 or len(two) not in (1, 2) or len(lms) > 1:
        return None
    roles = {"heat": heat[0]}
    how = "names"
    if len(two) == 1:
        roles["wh"] = two[0]
    elif _named(two[0], "wh") != _named(two[1], "wh") or _named(two[0], "offset") != _named(two[1], "offset"):
        wh = two[0] if _named(two[0], "wh") or _named(two[1], "offset") else two[1]
        roles.update(wh=wh, offset=two[1] if wh == two[0] else two[0])
    elif values is not None:  # offsets stay within their cell, sizes span several
        big = [float(np.median(np.abs(np.concatenate([x.reshape(-1) for x in values[k]])))) for k in two]
        wh = two[int(np.argmax(big))]
        roles.update(wh=wh, offset=two[1] if wh == two[0] else two[0])
        how = "values"
    else:
        return None
    if lms:
        roles["landmarks"] = lms[0]
    what = (f"a CenterNet head: heat map {roles['heat']!r} [{maps[roles['heat']][0]}, H, W], sizes {roles['wh']!r}"
            + (f", offsets {roles['offset']!r}" if "offset" in roles else "")
            + (f", landmarks {roles['landmarks']!r} [{maps[lms[0]][0]}, H, W]" if lms else "")
            + f" on one grid (sizes told from offsets by their {how})")
    if values is None:
        return roles, False, what + " by the shapes alone"
    heat_v = [np.asarray(x, np.float64) for x in values[roles["heat"]]]
    # an offset moves the centre within its cell or into a neighbour (CenterFace's real ones: -0.60..0.62)
    off_ok = "offset" not in roles or all(float(x.min()) > -1.0 and float(x.max()) < 2.0
                                          for x in values[roles["offset"]])
    wh_ok = max(float(np.asarray(x).max()) for x in values[roles["wh"]]) > 0.5
    peaks = any(float(x.max()) > 0.25 if in_unit(x) else float(x.max()) > -1.1 for x in heat_v)
    sure = off_ok and wh_ok and peaks
    layout, layout_sure, why = _size_layout([np.asarray(w, np.float64) for w in values[roles["wh"]]], heat_v)
    roles["format"] = layout
    what += f"; {why}"
    if not layout_sure:
        roles["other_format"] = "centerface" if layout == "centernet" else "centernet"
    sure = sure and layout_sure
    return roles, sure, what + ("; values agree (offsets within a cell, sizes over a cell, heat peaks)" if sure
                                else "; the values do not bear it out (offsets, sizes, peaks or the size layout)")


MIN_LAYOUT_PEAKS = 8  # peaks whose heat spread is measured before the size layout is told from it


def _size_layout(wh: list[np.ndarray], heat: list[np.ndarray]) -> tuple[str, bool, str]:
    """(format, sure, why): are the sizes at the heat map's peaks linear (centernet) or log sizes (centerface)?
    Below 0 at a peak: log sizes. A log-size reading whose boxes outgrow the grid: linear. Else the heat spread
    decides: a CenterNet heat map is a Gaussian whose sigma grows in proportion to the object's size, so the right
    reading keeps log(size) - log(sigma) near constant over the peaks (sigma from each peak's four neighbours:
    ratio q = exp(-1 / (2 sigma^2))); sure when its spread is at most half the other reading's, else unsure."""
    grid = max(heat[0].shape[-2:]) if heat else 0
    sizes, sigmas = [], []
    for w, h in zip(wh, heat, strict=True):
        p, w = h.reshape(-1, *h.shape[-2:]), w.reshape(-1, *w.shape[-2:])
        p = p if in_unit(p) else 1 / (1 + np.exp(-np.clip(p, -60, 60)))
        c, y, x = np.nonzero((p >= _pool3(p)) & (p >= 0.25))
        if not len(y):
            continue
        sizes.append(w[:, y, x].T)
        q = np.pad(p, [(0, 0), (1, 1), (1, 1)], mode="edge")
        near = (q[c, y, x + 1] + q[c, y + 2, x + 1] + q[c, y + 1, x] + q[c, y + 1, x + 2]) / 4
        sigmas.append(np.clip(near / np.maximum(p[c, y, x], 1e-9), 1e-6, 1 - 1e-6))
    if not sizes:
        return "centernet", False, "no heat peak shows how the sizes are laid out (centernet or centerface)"
    s = np.concatenate(sizes)
    if float(s.min()) < 0:
        return "centerface", True, "sizes below 0 at the peaks are log sizes: CenterFace's layout"
    if float(np.exp(np.clip(s, -20, 20)).max()) > 2 * grid:
        return "centernet", True, f"sizes read as log sizes would outgrow the {grid}-cell grid: linear sizes"
    log_sigma = 0.5 * np.log(-1 / (2 * np.log(np.concatenate(sigmas))))
    spread = {"centernet": float(np.std(0.5 * np.log(np.maximum(s[:, 0] * s[:, 1], 1e-12)) - log_sigma)),
              "centerface": float(np.std((s[:, 0] + s[:, 1]) / 2 - log_sigma))}
    best, other = sorted(spread, key=lambda k: spread[k])
    told = (f"{len(s)} peaks: log(size / heat sigma) spreads {spread['centernet']:.3f} read as linear sizes "
            f"(centernet), {spread['centerface']:.3f} as log sizes (centerface)")
    if len(s) >= MIN_LAYOUT_PEAKS and spread[best] <= 0.5 * spread[other]:
        return best, True, f"{told}: {best}'s layout"
    return best, False, f"sizes all above 0 and {told}: centernet and centerface cannot be told apart"
