"""The compile's front door: the model file as every later step reads it.

Two shapes models are shipped in that the build steps cannot take as they are, each turned into one they can and
named in the build notes (manifest ``build_notes``, the report's "build" lines):

- weights in external data files: embedded in one self-contained file (:mod:`compiler.external`);
- a batch fixed larger than 1 by the export: its first dimension made dynamic where the graph allows it, checked
  against the original (:mod:`compiler.batch`); where it does not, the model is served at that batch (the engine
  pads smaller batches up to it and slices the outputs: manifest ``fixed_batch``), and the note says why.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .batch import dynamic_batch
from .buildnotes import note
from .external import embedded

__all__ = ["source_model"]


def source_model(model: Path, folder: Path, progress: Callable[[int, int, str], None]) -> Path:
    """``model`` as the build reads it: itself, or a rewritten copy in ``folder`` (same file name)."""
    if not model.is_file():
        return model  # the compile's checks say it is missing
    model, how = embedded(model, folder / "embedded")
    if how:
        note("source model", "external data embedded", how)
        progress(2, 7, f"note: {how}")
    model, how, why_not = dynamic_batch(model, folder / "batch")
    if how:
        note("source model", "fixed batch made dynamic", how)
        progress(2, 7, f"note: {how}")
    elif why_not:  # check_model reads the fixed batch; the engines pad up to it (engines.base.Engine.infer)
        note("source model", "served at its fixed batch: smaller batches padded up to it, larger ones run in pieces",
             f"the first dimension cannot be made dynamic: {why_not}")
        progress(2, 7, f"note: the fixed batch stays ({why_not}); the engine pads smaller batches up to it")
    return model
