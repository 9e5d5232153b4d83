"""What each file of a bundle is, by its content (stdlib only; the bundle reader and writer call it).

A manifest names its engine and self-test sample (and each variant's) by file name; names prove nothing about
content, so a manifest whose roles are swapped (an ``.npz`` as the engine) would be signed, stored and sent.
:func:`role_problem` reads the start (and for a zip, the end) of each file and refuses one that is not what its
role needs:

    role          backend        what the file must be
    engine        onnxruntime    an ONNX ModelProto (its top-level protobuf fields walked to the end, ir_version
                                 and graph present) or an ORT-format model (identifier ``ORTM`` at byte 4)
    engine        litert         a TFLite flatbuffer (identifier ``TFL3`` at byte 4)
    engine        tensorrt       not a zip archive. A TensorRT plan has no documented header, so this check is
                                 weak on purpose: it refuses only what is certainly another role's file (an
                                 .npz); TensorRT checks the plan itself when the agent loads it
    self-test     any            an .npz: a zip archive whose members are all ``.npy`` arrays, with
                                 ``input:<name>`` for each of the manifest's inputs and ``expected:<name>``
                                 for each of its outputs

Work is bounded: an ONNX walk reads one tag and length a field, at most :data:`MAX_ONNX_FIELDS` fields; a zip's
central directory is read only if it lists at most :data:`MAX_NPZ_MEMBERS` members in at most
:data:`MAX_NPZ_DIRECTORY_BYTES`.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Callable
from typing import IO

from .manifest import Manifest

__all__ = ["MAX_NPZ_DIRECTORY_BYTES", "MAX_NPZ_MEMBERS", "MAX_ONNX_FIELDS", "engine_problem", "role_problem",
           "selftest_problem"]

MAX_ONNX_FIELDS = 10_000  # top-level fields of a ModelProto: a real one has about ten (opsets, metadata: dozens)
MAX_NPZ_MEMBERS = 4096  # arrays in a self-test sample: an input and an output per tensor, labels
MAX_NPZ_DIRECTORY_BYTES = 1024**2
# ModelProto's fields and their wire types (onnx.proto: 0 varint, 2 length-delimited); others are allowed
# (a newer onnx) if their wire type is valid
_MODEL_PROTO = {1: 0, 2: 2, 3: 2, 4: 2, 5: 0, 6: 2, 7: 2, 8: 2, 14: 2, 20: 2, 25: 2}
_ZIP_LOCAL, _ZIP_END = b"PK\x03\x04", b"PK\x05\x06"
_EOCD = struct.Struct("<4s4H2LH")  # the end-of-central-directory record, 22 bytes

Opener = Callable[[str], IO[bytes]]


def _varint(buf: bytes, i: int) -> tuple[int, int] | None:
    """A protobuf varint at ``buf[i:]``: (value, index after it), or None if it is cut or over 10 bytes."""
    value = shift = 0
    for j in range(i, min(len(buf), i + 10)):
        value |= (buf[j] & 0x7F) << shift
        if not buf[j] & 0x80:
            return value, j + 1
        shift += 7
    return None


def _onnx_problem(f: IO[bytes], size: int) -> str | None:
    pos, seen = 0, set()
    for _ in range(MAX_ONNX_FIELDS):
        if pos == size:
            break
        f.seek(pos)
        head = f.read(22)  # a tag and a length: two varints of at most 10 bytes, or a tag and a fixed64
        tag = _varint(head, 0)
        if tag is None:
            return f"byte {pos} does not start a protobuf field"
        field, wire = tag[0] >> 3, tag[0] & 7
        if field == 0 or wire not in (0, 1, 2, 5) or _MODEL_PROTO.get(field, wire) != wire:
            return f"byte {pos} does not start a ModelProto field (field {field}, wire type {wire})"
        if wire == 0:
            value = _varint(head, tag[1])
            if value is None:
                return f"the field at byte {pos} is cut short"
            pos += value[1]
        elif wire in (1, 5):
            pos += tag[1] + (8 if wire == 1 else 4)
        else:
            length = _varint(head, tag[1])
            if length is None:
                return f"the field at byte {pos} is cut short"
            pos += length[1] + length[0]
        if pos > size:
            return f"field {field} runs past the end of the file"
        seen.add(field)
    else:
        if pos != size:
            return f"more than {MAX_ONNX_FIELDS} top-level fields"
    missing = [n for k, n in ((1, "ir_version"), (7, "graph")) if k not in seen]
    return f"no {' or '.join(missing)}" if missing else None


def _looks_like(head: bytes) -> str:
    """What a file that failed its role looks like, when that is clear (a hint at swapped roles)."""
    if head[:4] in (_ZIP_LOCAL, _ZIP_END):
        return "a zip archive (an .npz self-test sample?)"
    if head[4:8] == b"TFL3":
        return "a TFLite model"
    if head[4:8] == b"ORTM":
        return "an ORT-format model"
    if head[:1] == b"\x08":  # ModelProto's first field as onnx writes it: ir_version, a varint
        return "an ONNX model"
    return ""


def engine_problem(backend: str, f: IO[bytes], size: int) -> str | None:
    """Why ``f`` (of ``size`` bytes) cannot be an engine for ``backend``, or None."""
    f.seek(0)
    head = f.read(8)
    looks = _looks_like(head)
    if backend == "onnxruntime":
        if head[4:8] == b"ORTM":
            return None
        if head[:4] in (_ZIP_LOCAL, _ZIP_END):
            return f"is {looks}, not an ONNX model"
        problem = _onnx_problem(f, size)
        if problem is None:
            return None
        return f"is not an ONNX model ({problem})" + (f"; it looks like {looks}" if looks else "")
    if backend == "litert":
        return None if head[4:8] == b"TFL3" else ("is not a TFLite flatbuffer (no TFL3 identifier at byte 4)"
                                                   + (f"; it looks like {looks}" if looks else ""))
    if backend == "tensorrt":
        return f"is {looks}, not a TensorRT plan" if head[:4] in (_ZIP_LOCAL, _ZIP_END) else None
    return f"has backend {backend!r}, which this edgefleet cannot check"


def selftest_problem(f: IO[bytes], size: int, manifest: Manifest) -> str | None:
    """Why ``f`` (of ``size`` bytes) cannot be ``manifest``'s self-test sample, or None."""
    f.seek(0)
    head = f.read(8)
    if head[:4] != _ZIP_LOCAL:
        looks = _looks_like(head)
        return "is not an .npz (a zip archive of .npy arrays)" + (f"; it looks like {looks}" if looks else "")
    tail_len = min(size, _EOCD.size + 0xFFFF)
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    at = tail.rfind(_ZIP_END)
    if at < 0 or at + _EOCD.size > len(tail):
        return "is not an .npz (a zip archive with no end-of-central-directory record)"
    _, _, _, _, entries, dir_size, _, _ = _EOCD.unpack_from(tail, at)
    if entries > MAX_NPZ_MEMBERS or dir_size > MAX_NPZ_DIRECTORY_BYTES:
        return (f"lists {entries} members in a {dir_size}-byte directory, over the {MAX_NPZ_MEMBERS}-member / "
                f"{MAX_NPZ_DIRECTORY_BYTES}-byte limit of a self-test sample")
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as exc:
        return f"is not a readable .npz ({' '.join(str(exc).split()) or type(exc).__name__})"
    if len(names) > MAX_NPZ_MEMBERS:
        return f"has more than {MAX_NPZ_MEMBERS} members"
    # (a tensor name may hold '/', as TensorFlow and Paddle exports' do: the members are read by numpy, never
    # extracted to disk, so a slash in one is a name, not a path)
    odd = [n for n in names if not n.endswith(".npy")]
    if odd:
        return f"holds {', '.join(repr(n) for n in odd[:3])}, not .npy arrays: not an .npz"
    want = [f"input:{t.name}" for t in manifest.inputs] + [f"expected:{t.name}" for t in manifest.outputs]
    missing = [w for w in want if f"{w}.npy" not in names]
    if missing:
        return (f"lacks {', '.join(repr(m) for m in missing[:4])}: a self-test sample holds input:<name> and "
                "expected:<name> for each of the model's inputs and outputs")
    return None


def role_problem(manifest: Manifest, open_file: Opener, sizes: dict[str, int]) -> str | None:
    """What is wrong with the first file that is not what its role in ``manifest`` needs, or None (the bundle
    reader raises it as a BundleError). ``open_file(name)`` opens a file of the bundle for reading (seekable);
    ``sizes[name]`` is its size in bytes."""
    roles = [("engine", manifest.engine, manifest.selftest)]
    roles += [(f"{v.precision} engine", v.engine, v.selftest) for v in manifest.variants]
    for role, engine, selftest in roles:
        with open_file(engine) as f:
            problem = engine_problem(manifest.backend, f, sizes[engine])
        if problem:
            return f"the {role} {engine!r} {problem}"
        with open_file(selftest) as f:
            problem = selftest_problem(f, sizes[selftest], manifest)
        if problem:
            return f"the {role.replace('engine', 'self-test sample')} {selftest!r} {problem}"
    return None
