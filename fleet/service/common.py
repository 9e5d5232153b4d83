"""What the fleet's area services share: the bounds of a device's labels and tags (``check_labels``, which the API,
the console and the CLI say too), the publisher they send desired states through, and small helpers."""

from __future__ import annotations

import datetime as dt
from typing import Protocol

from ..errors import BadRequest

__all__ = ["MAX_LABELS", "MAX_LABEL_KEY_CHARS", "MAX_LABEL_VALUE_CHARS", "MAX_TAGS", "MAX_TAG_CHARS", "Publisher",
           "check_labels", "iso"]

# a device's labels and tags are shown in every listing: bounded in number and length
MAX_LABELS = 32
MAX_LABEL_KEY_CHARS = 64
MAX_LABEL_VALUE_CHARS = 256
MAX_TAGS = 32
MAX_TAG_CHARS = 64


def check_labels(labels: dict[str, str] | None = None, tags: list[str] | None = None) -> None:
    """Labels and tags within their bounds, else BadRequest (422) naming the first that is not."""
    if labels is not None:
        if len(labels) > MAX_LABELS:
            raise BadRequest(f"{len(labels)} labels: a device has at most {MAX_LABELS}", 422)
        for k, v in labels.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise BadRequest("labels map names to strings", 422)
            if not 1 <= len(k) <= MAX_LABEL_KEY_CHARS:
                raise BadRequest(f"label name {k[:40]!r}{'...' if len(k) > 40 else ''} has {len(k)} characters: "
                                 f"1 to {MAX_LABEL_KEY_CHARS}", 422)
            if len(v) > MAX_LABEL_VALUE_CHARS:
                raise BadRequest(f"label {k!r} has a value of {len(v)} characters: at most {MAX_LABEL_VALUE_CHARS}",
                                 422)
    if tags is not None:
        if len(tags) > MAX_TAGS:
            raise BadRequest(f"{len(tags)} tags: at most {MAX_TAGS}", 422)
        for t in tags:
            if not isinstance(t, str) or not 1 <= len(t) <= MAX_TAG_CHARS:
                shown = f"{t[:40]!r}{'...' if len(t) > 40 else ''} has {len(t)} characters" if isinstance(t, str) \
                    else "is not a string"
                raise BadRequest(f"tag {shown}: 1 to {MAX_TAG_CHARS} characters", 422)


class Publisher(Protocol):
    def publish(self, topic: str, payload: bytes, retain: bool) -> None: ...


def iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.replace(tzinfo=dt.UTC).isoformat()
