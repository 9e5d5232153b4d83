"""A compile's options and result, its fixed limits, and the checks that need no model: names, paths, the
gate's bounds."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ...engines import EngineError, EngineInputError
from ...judge.errors import InputError as JudgeInputError
from ...judge.errors import JudgeError
from ...judge.gate import GateSettings
from ...judge.tasks import parse_tasks
from ...protocol.manifest import NAME_RE, VERSION_RE, Manifest
from ...protocol.profile import HardwareProfile
from ..errors import CompilerError, InputError, ToolchainError

SELFTEST_MAX_SAMPLES = 64


SELFTEST_MAX_INPUT_BYTES = 1 << 20  # the sample travels in every bundle: keep it small for big inputs


SELFTEST_MAX_BYTES = 1 << 20  # the compressed self-test file, inputs and expected outputs together


MIN_CALIBRATION_SAMPLES = 16  # fewer gives activation ranges from a handful of inputs


# auto: an int8 engine whose output no task reads ships only when that output keeps to this relative L2 against fp32
# (40 dB SQNR: about one 8-bit step of a range twice the output's RMS); nothing judges what a larger change does
UNJUDGED_MAX_REL_L2 = 1e-2


REFERENCE_RUNTIME = "onnxruntime"  # runs the fp32 source model (ONNX) on the build host's CPU: the reference


Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class CompileOptions:
    model: Path
    profile: str
    calibration: Path | None
    eval: Path
    out_dir: Path
    name: str
    version: str
    precision: str = "auto"  # "auto", or one of the profile's precisions
    max_accuracy_drop: float | None = None  # default: the profile's accuracy.max_drop
    benchmark: bool = True
    gate: str = "auto"  # "auto" (accuracy with labels, agreement without), "accuracy", "agreement"
    min_agreement: float | None = None  # default: the profile's accuracy.min_agreement
    agreement_metric: str = "auto"  # "auto", "top1" or "cosine" (embeddings)
    cache_dir: Path | None = None  # reuse a bundle built from identical inputs (compiler.cache); None: always build
    preprocess: Path | None = None  # preprocess.yaml: how images become the input (default: from the input shape)
    fallback: bool = True  # int8 over budget: keep the most sensitive layers in float until it passes (onnxruntime)
    task: str | None = None  # what the model is for (judge.tasks); None: MODEL.task.yaml, else inferred
    task_args: str | None = None  # 'k=v,...' for the task (e.g. 'format=yolov8,score=0.25')
    keep_engines: Path | None = None  # copy every candidate engine built (passed or not) here: bench/corpus.py


@dataclass(frozen=True)
class CompileResult:
    bundle: Path
    manifest: Manifest
    cached: bool = False


def no_progress(step: int, total: int, what: str) -> None:
    pass


@contextlib.contextmanager
def compiler_errors() -> Iterator[None]:
    """Engine and judge errors as the compiler's (a refused feed or unjudgeable data: InputError; any other engine
    failure: ToolchainError); compile_model and compile_pipeline translate the same way."""
    try:
        yield
    except CompilerError:
        raise
    except (EngineInputError, JudgeInputError) as exc:
        raise InputError(str(exc)) from exc
    except EngineError as exc:
        raise ToolchainError(str(exc)) from exc
    except JudgeError as exc:
        raise CompilerError(str(exc)) from exc


def validate(opts: CompileOptions) -> None:
    """Everything that can be checked before any work: names, version, paths, task."""
    if not NAME_RE.fullmatch(opts.name):
        fixed = re.sub(r"[^a-z0-9._-]+", "-", opts.name.lower()).strip("-._")[:63] or "model"
        raise InputError(f"--name {opts.name!r}: names are 1-63 of [a-z0-9._-], starting with a letter or digit "
                         f"(try --name {fixed})")
    if not VERSION_RE.fullmatch(opts.version):
        raise InputError(f"--version {opts.version!r} is not MAJOR.MINOR.PATCH (e.g. 1.0.0)")
    for flag, path in (("model", opts.model), ("--eval", opts.eval), ("--calibration", opts.calibration),
                       ("--preprocess", opts.preprocess)):
        if path is not None and not path.exists():
            raise InputError(f"{path}: {flag} file not found")
    if opts.task:
        parse_tasks(opts.task, opts.task_args)
    elif opts.task_args:
        raise InputError("--task-args needs --task NAME")
    if opts.out_dir.exists() and not opts.out_dir.is_dir():
        raise InputError(f"--out {opts.out_dir}: not a folder")


def gate_settings(opts: CompileOptions, profile: HardwareProfile) -> GateSettings:
    """The gate's bounds: the flags, else the profile's; and the precision asked for, checked against the profile."""
    if opts.precision != "auto" and opts.precision not in profile.precisions:
        raise InputError(f"profile {profile.name} supports {list(profile.precisions)} or 'auto', "
                         f"not {opts.precision!r}")
    gate = GateSettings(
        kind=opts.gate,  # type: ignore[arg-type]
        max_accuracy_drop=profile.accuracy.max_drop if opts.max_accuracy_drop is None else opts.max_accuracy_drop,
        min_agreement=profile.accuracy.min_agreement if opts.min_agreement is None else opts.min_agreement,
        metric=opts.agreement_metric,  # type: ignore[arg-type]
        max_unjudged_change=UNJUDGED_MAX_REL_L2 if opts.precision == "auto" else None)
    if not 0.0 <= gate.max_accuracy_drop <= 1.0:
        raise InputError(f"--max-accuracy-drop must be between 0 and 1, got {gate.max_accuracy_drop}")
    if not 0.0 <= gate.min_agreement <= 1.0:
        raise InputError(f"--min-agreement must be between 0 and 1, got {gate.min_agreement}")
    return gate
