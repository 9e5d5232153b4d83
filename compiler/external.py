"""Models whose weights lie in external data files (``model.onnx`` + ``model.onnx.data``, or one file per tensor).

Every exporter writes this layout past 2 GB, and many always. The compiler copies the model file into work folders
(the targets' prepared copies, the quantizer's temporary folder), where the data files are not, so each step that
loads it fails. The compile's front door (:func:`embedded`) loads the weights once from the folder the model lies in
and writes one self-contained ONNX file that every later step reads, so the bundle's engine carries its weights
inside it and the agent loads one file, as for any other model: nothing in the bundle format, the agent or the
engines changes, and the manifest's sha256 of the engine covers the weights. A model too big for one ONNX file
(protobuf's 2 GB) is refused with what to do; a data file that is missing is named.
"""

from __future__ import annotations

from pathlib import Path

from .errors import InputError

__all__ = ["MAX_EMBEDDED_BYTES", "data_files", "embedded"]

# protobuf serializes at most 2 GiB; a margin for the graph itself and the framing of every tensor
MAX_EMBEDDED_BYTES = (2 << 30) - (64 << 20)


def data_files(model: Path) -> list[Path]:
    """The external data files ``model`` names (relative to its folder), in order, each once; [] when its weights
    are inside it. Reads only the graph, never the weights."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    try:
        proto = onnx.load(str(model), load_external_data=False)
    except Exception:  # not a readable ONNX file: check_model says why
        return []
    names: dict[str, None] = {}
    for t in _get_all_tensors(proto):
        if uses_external_data(t):
            names[ExternalDataInfo(t).location] = None
    return [model.parent / n for n in names]


def embedded(model: Path, folder: Path) -> tuple[Path, str]:
    """``model`` as one self-contained file in ``folder`` (same file name) and the note saying so; ``model`` itself
    and "" when its weights are inside it already."""
    import onnx

    files = data_files(model)
    if not files:
        return model, ""
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise InputError(f"{model}: the model keeps its weights in external data file(s) {missing}, not found in "
                         f"{model.parent}; put every data file the exporter wrote beside the model file (they are "
                         "read relative to it)")
    size = sum(f.stat().st_size for f in files) + model.stat().st_size
    if size > MAX_EMBEDDED_BYTES:
        raise InputError(f"{model}: {size / (1 << 30):.2f} GiB of weights in {len(files)} external data file(s); an "
                         "edgefleet engine is one ONNX file, which holds at most 2 GiB (protobuf's limit): reduce the "
                         "model below 2 GiB (export it in float16, or quantize its weights with onnxruntime's "
                         "quantize_dynamic: a quantized model compiles as given under --precision auto)")
    try:
        proto = onnx.load(str(model), load_external_data=True)
    except Exception as exc:  # onnx raises assorted types for a short or unreadable data file
        raise InputError(f"{model}: cannot read its external data {[f.name for f in files]}: "
                         f"{' '.join(str(exc).split())[:300]}") from exc
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / model.name
    onnx.save(proto, str(out))  # every tensor inside the file
    what = files[0].name if len(files) == 1 else f"{len(files)} files"
    return out, (f"weights read from external data ({what}, {size / (1 << 20):.1f} MiB) and embedded in the engine "
                 "file, so the bundle carries them in one file")
