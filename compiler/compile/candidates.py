"""The candidates a compile builds (:class:`Built`) and the engines it runs them with (:class:`CompileEngines`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...engines import Engine, EngineSpec, Runtime, record
from ...engines import load as load_engine
from ...judge.predict import Runner
from ...protocol.manifest import AccuracyReport, BenchmarkPoint, QuantizationInfo
from ...protocol.profile import HardwareProfile
from ..graph import GraphInfo


@dataclass
class Built:
    precision: str
    engine: Path
    runner: Runner
    quantization: QuantizationInfo | None
    accuracy: AccuracyReport
    points: tuple[BenchmarkPoint, ...] = ()


class CompileEngines:
    """The engines a compile runs (the fp32 reference, each candidate), loaded through :func:`engines.load` as
    the agent loads them, with the profile's threads; all closed when the compile ends."""

    def __init__(self, info: GraphInfo, profile: HardwareProfile):
        self.info = info
        self.profile = profile
        self.runtime: Runtime = record(profile.backend)  # what the profile's engines are: name, file suffix
        self.opened: list[Engine] = []

    def open(self, kind: str, path: Path, precision: str, label: str,
             providers: tuple[str, ...] | None = None) -> Runner:
        spec = EngineSpec(self.info.inputs, self.info.outputs, precision, self.profile.name, label,
                          fixed_batch=self.info.fixed_batch)
        engine = load_engine(kind, path, spec, self.profile.runtime.intra_op_threads, providers)
        self.opened.append(engine)
        return engine.infer

    def close(self) -> None:
        for engine in self.opened:
            engine.close()
        self.opened.clear()
