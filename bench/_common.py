"""What the bench scripts share: progress on stderr, the models they compile, and the folder a run keeps its
files in. bench/ is not a package: a script finds this module in its own folder (``python bench/x.py`` puts that
folder first on sys.path)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

REPO = Path(__file__).resolve().parent.parent
ZOO_SCRIPT = REPO / "models" / "zoo" / "make_zoo.py"

def say(msg: str) -> None:
    """Progress, on stderr (stdout may carry a JSON document)."""
    print(msg, file=sys.stderr, flush=True)


def load_zoo() -> ModuleType:
    """models/ is not a package: load the zoo script by path, as the tests do."""
    spec = importlib.util.spec_from_file_location("make_zoo", ZOO_SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_files(name: str) -> tuple[Path, Path, Path, str, str]:
    """(model, calibration set, evaluation set, precision, model name) of a served bench model: ``digits`` (INT8)
    or ``mobilenetv2-<precision>`` (the zoo's MobileNetV2-like model, built on first use)."""
    if name == "digits":
        d = REPO / "models" / "digits"
        return d / "model.onnx", d / "calibration.npz", d / "test.npz", "int8", "digits"
    d = load_zoo().ensure("mobilenetv2")
    return d / "model.onnx", d / "calibration.npz", d / "eval.npz", name.rsplit("-", 1)[1], "mobilenetv2"


def run_and_report(args: argparse.Namespace, run: Callable[[argparse.Namespace, Path], dict[str, Any]],
                   print_report: Callable[[dict[str, Any], TextIO], None], prefix: str) -> int:
    """A bench script's run: ``run(args, folder)`` in ``args.work_dir`` (made if missing; its files kept) or, without
    one, in a temporary folder named ``prefix...`` removed after; then its document's table (on stderr with
    ``args.json``: stdout then carries the JSON document alone) and its time. -> the exit status: 0, or 130 when
    interrupted (Ctrl-C)."""
    try:
        if args.work_dir is not None:
            args.work_dir.mkdir(parents=True, exist_ok=True)
            doc = run(args, args.work_dir.resolve())
        else:
            with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
                doc = run(args, Path(tmp))
    except KeyboardInterrupt:
        return 130
    print_report(doc, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(doc, indent=2))
    say(f"done in {doc['total_seconds']:.1f}s")
    return 0
