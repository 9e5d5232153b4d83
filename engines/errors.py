"""Engine errors, split by who is at fault.

    EngineError
    ├── EngineLoadError    the engine cannot be loaded here: its runtime is missing or too old, the file is
    │                      not an engine of its kind, or its tensors are not the ones the spec names
    ├── EngineInputError   a feed does not match the engine's input specs (the caller's fault)
    ├── EngineClosed       infer() after close()
    └── EngineRunError     the runtime failed on a batch, or returned outputs that break the spec

Errors from onnxruntime, LiteRT, TensorRT and CUDA are translated here and raised ``from exc``; the agent
and the compiler translate these in turn at their own boundaries (an update that cannot be installed, a
build toolchain that failed).
"""

from __future__ import annotations

from ..protocol.errors import EdgefleetError

__all__ = ["EngineClosed", "EngineError", "EngineInputError", "EngineLoadError", "EngineRunError"]


class EngineError(EdgefleetError):
    pass


class EngineLoadError(EngineError):
    pass


class EngineInputError(EngineError):
    pass


class EngineClosed(EngineError):
    pass


class EngineRunError(EngineError):
    pass
