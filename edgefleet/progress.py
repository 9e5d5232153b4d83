"""The compiler's progress on stderr, shared by ``edgefleet compile`` and ``edgefleet demo``: a bar redrawn in
place on a terminal, one plain line per step in a log file or a CI pipe."""

from __future__ import annotations

import sys

__all__ = ["progress_bar"]

_last_line: list[str] = [""]  # the last plain line written (not on a terminal: one line per step, no repeats)


def _is_note(what: str) -> bool:
    return what.startswith("note: ") or "] note: " in what  # a finding to keep on screen, e.g. the inferred task


def progress_bar(step: int, total: int, what: str) -> None:
    width = 24
    filled = int(width * step / total)
    if not sys.stderr.isatty():  # a log file or a CI pipe: plain lines, never a \r redraw
        line = what if _is_note(what) else f"[{step}/{total}] {what}"
        if line != _last_line[0]:
            _last_line[0] = line
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        return
    if _is_note(what):
        sys.stderr.write(f"\r{' ' * (width + 70)}\r{what}\n")
        sys.stderr.flush()
        return
    sys.stderr.write(f"\r[{'#' * filled}{'-' * (width - filled)}] {step}/{total} {what:<60}")
    if step == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
