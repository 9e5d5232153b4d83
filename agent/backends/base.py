"""The backend interface: one runtime per module, each implementing only this."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from protocol.manifest import Manifest, TensorSpec

__all__ = ["NP_DTYPES", "Backend"]

NP_DTYPES: dict[str, type] = {"FP32": np.float32, "FP16": np.float16, "INT8": np.int8, "UINT8": np.uint8,
                              "INT32": np.int32, "INT64": np.int64, "BOOL": np.bool_}


class Backend(ABC):
    """Load an engine, describe its tensors, run a batch, close.

    ``infer`` is called from one inference thread at a time per instance; inputs are already validated
    against ``inputs`` (names, dtypes, shapes), so implementations only run the engine. Several instances
    of one backend class may be loaded at once (one per batcher instance); they share nothing.
    """

    name: str = "?"

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        # what actually runs the engine once loaded, e.g. "CPUExecutionProvider", "CUDAExecutionProvider",
        # "XNNPACK (4 threads)", "TensorRT 10.3.0 on sm87": reported in model metadata and logs
        self.device: str = "?"

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.manifest.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self.manifest.outputs

    @abstractmethod
    def load(self, engine: Path, threads: int) -> None: ...

    @abstractmethod
    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Outputs in the order of ``outputs``, each with the same batch size as the inputs."""

    def warm_up_sizes(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """Of the batch sizes the batcher will form (ascending), those to run once before the version takes
        traffic: every one by default (a runtime that sets up per shape pays that on the first call)."""
        return sizes

    @abstractmethod
    def close(self) -> None:
        """Release the engine (idempotent)."""
