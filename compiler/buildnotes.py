"""The build's record of what it did beside the plain path (manifest ``build_notes``, the report's "build" lines).

A quantizer retried with another option, a graph quantized raw because onnxruntime's pre-processing failed, the
float fallback's steps, external data embedded, a batch dimension made dynamic: each is noted where it happens
(:func:`note`) and lands in the manifest the compile writes, whichever candidate it belonged to, so the manifest
never presents a workaround as a normal build. Notes are collected per compile (:func:`collecting`, a context
variable: two compiles in one process keep theirs apart); a note made outside one is dropped.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from ..protocol.manifest import BUILD_NOTES_VERSION, FIXED_BATCH_VERSION, BuildNote, Manifest

__all__ = ["collecting", "note", "with_build_notes"]

_NOTES: contextvars.ContextVar[list[BuildNote] | None] = contextvars.ContextVar("edgefleet_build_notes", default=None)
MAX_NOTES = 256  # the manifest's bound


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def note(step: str, action: str, reason: str) -> None:
    """Record one retry, fallback or workaround of the compile under way (the same note once)."""
    notes = _NOTES.get()
    if notes is None:
        return
    n = BuildNote(step=_clip(step, 200), action=_clip(action, 1000), reason=_clip(reason, 2000))
    if n not in notes and len(notes) < MAX_NOTES:
        notes.append(n)


@contextlib.contextmanager
def collecting() -> Iterator[list[BuildNote]]:
    """The notes of the compile run inside this block, in order."""
    notes: list[BuildNote] = []
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)


def with_build_notes(manifest: Manifest, fixed_batch: int | None = None) -> Manifest:
    """``manifest`` carrying the notes of the compile under way and the batch its engine is fixed at, if any (its
    version raised to carry them); as it was when there are neither."""
    notes = _NOTES.get()
    if not notes and fixed_batch is None:
        return manifest
    return Manifest.model_validate({**manifest.model_dump(), "build_notes": tuple(notes or ()),
                                    "fixed_batch": fixed_batch,
                                    "manifest_version": max(manifest.manifest_version, BUILD_NOTES_VERSION,
                                                            FIXED_BATCH_VERSION if fixed_batch else 0)})
