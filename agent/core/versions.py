"""Integer model versions for Triton's tools, beside the bundles' semantic versions.

Triton's versions are integers (a model repository's numbered folders), and its tools read them so:
perf_analyzer parses a version with ``stoll`` and looks its statistics up by that number. A bundle's version is
semantic (``1.0.0``). The agent gives each (model, semantic version) it serves a number the first time it serves
it: 1, 2, 3, ... per model, never reused, kept in ``version-numbers.json`` in the agent's data dir so a restart
(or a rollback to an older bundle) keeps every version's number. The Open Inference Protocol shows the number
where Triton's tools read one (statistics, the configuration's ``version_policy``) and accepts either where a
client names a version (``/v2/models/digits/versions/3/infer`` or ``/versions/1.0.0/infer``); the semantic version
stays in the model's metadata, its configuration's ``parameters.semantic_version`` and everything the fleet sees.
docs/api.md writes the mapping down.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from ...protocol.fsutil import atomic_write

__all__ = ["MAX_FILE_BYTES", "MAX_VERSIONS_PER_MODEL", "VersionNumbers"]

log = logging.getLogger("edgefleet.agent.versions")

MAX_FILE_BYTES = 1024 * 1024  # the mapping's file is read only up to this size (else started afresh, logged)
MAX_VERSIONS_PER_MODEL = 256  # the oldest numbers beyond these are forgotten (numbers still never go back)
MAX_MODELS = 1024
MAX_NUMBER = 2**62  # stoll's range, with room


class VersionNumbers:
    """model -> {semantic version: number}, numbers increasing per model; persisted at ``path`` (None: memory)."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self._lock = threading.Lock()
        self._models: dict[str, dict[str, int]] = {}
        self._next: dict[str, int] = {}
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cannot read %s (%s): version numbers start afresh", path, exc)
            return
        try:
            if len(raw) > MAX_FILE_BYTES:
                raise ValueError(f"over {MAX_FILE_BYTES} bytes")
            doc = json.loads(raw)
            models = doc["models"]
            if not isinstance(models, dict) or len(models) > MAX_MODELS:
                raise ValueError(f"'models' is not an object of at most {MAX_MODELS} models")
            for name, entry in models.items():
                numbers = entry["versions"]
                nxt = entry["next"]
                if not isinstance(numbers, dict) or len(numbers) > MAX_VERSIONS_PER_MODEL or \
                        not all(isinstance(v, int) and 0 < v < nxt for v in numbers.values()) or \
                        not isinstance(nxt, int) or not 0 < nxt < MAX_NUMBER:
                    raise ValueError(f"model {name!r}: bad numbers")
                self._models[str(name)] = {str(k): v for k, v in numbers.items()}
                self._next[str(name)] = nxt
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            log.warning("%s is not a version mapping (%s): version numbers start afresh", path, exc)
            self._models.clear()
            self._next.clear()

    def number(self, model: str, version: str) -> int:
        """``model`` ``version``'s number (given now, and written down, if it has none yet)."""
        with self._lock:
            numbers = self._models.setdefault(model, {})
            n = numbers.get(version)
            if n is not None:
                return n
            n = numbers[version] = self._next.get(model, 1)
            self._next[model] = n + 1
            while len(numbers) > MAX_VERSIONS_PER_MODEL:  # the oldest number goes
                del numbers[min(numbers, key=numbers.__getitem__)]
            self._save()
            return n

    def matches(self, model: str, version: str, ref: str) -> bool:
        """Whether a client's ``ref`` (a number or a semantic version) names ``model`` ``version``."""
        if ref == version:
            return True
        with self._lock:
            n = self._models.get(model, {}).get(version)
        return n is not None and ref.isdigit() and len(ref) < 20 and int(ref) == n

    def _save(self) -> None:
        if self.path is None:
            return
        doc = {"models": {m: {"next": self._next[m], "versions": v} for m, v in sorted(self._models.items())}}
        try:
            atomic_write(self.path, json.dumps(doc, indent=1, sort_keys=True).encode())
        except OSError as exc:  # serving goes on; the numbers hold until the process ends
            log.warning("cannot write %s (%s): version numbers kept in memory only", self.path, exc)
