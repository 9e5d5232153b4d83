"""One judge (issue 31.3): the compiler's gate and the agent's ``edgefleet verify`` judge with the same code,
``edgefleet.judge``, which imports neither of them. Before, half of it lived in protocol/evaluation.py and the rest in
compiler/gate.py and compiler/tasks.py, and verify imported the compiler to judge a label-free evaluation set."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.installs import loaded_after
from tests.test_verify_eval import _inputs, int8_bundle  # noqa: F401  (the fixture: an int8 bundle and its model)

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("edgefleet.compiler", "edgefleet.fleet", "onnx", "onnxruntime.quantization")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_verify_judges_a_label_free_set_on_a_box_without_the_compiler(int8_bundle, tmp_path):  # noqa: F811
    """A box with the agent alone: every ``edgefleet.compiler`` import fails, and verify still judges 300 samples by
    the task the bundle recorded, against the fp32 source model."""
    bundle, model = int8_bundle
    np.savez(tmp_path / "far.npz", x=_inputs(4, 300, (2.0, 4.0)))
    code = ("import sys; sys.modules['edgefleet.compiler'] = None\n"  # `import edgefleet.compiler...` now raises
            "from pathlib import Path\n"
            "from edgefleet.agent.install.verify import verify_bundle\n"
            f"r = verify_bundle(Path({str(bundle)!r}), Path({str(tmp_path / 'far.npz')!r}), "
            f"reference=Path({str(model)!r}))\n"
            "print(r.gate.passed, r.gate.eval_samples, r.gate.task.task, r.holds)\n"
            f"print([m for m in {HEAVY!r} if sys.modules.get(m) is not None])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["True 300 regression True", "[]"]


def test_importing_verify_and_the_judge_loads_neither_the_compiler_nor_its_toolchain():
    modules = ("edgefleet.agent.install.verify, edgefleet.judge.gate, edgefleet.judge.tasks, edgefleet.judge.data, "
               "edgefleet.judge.predict")
    assert loaded_after(modules, HEAVY) == []


def test_verify_names_no_compiler_module_and_the_judge_imports_neither_side():
    """Function-level imports included: a lazy ``from edgefleet.compiler...`` inside verify is still the agent
    depending on the compiler. The judge is owned by neither: it imports the protocol and numpy, not the compiler,
    the agent, the fleet or a runtime."""
    assert not {m for m in _imports(REPO / "agent" / "install" / "verify.py") if m.startswith("edgefleet.compiler")}
    for path in sorted((REPO / "judge").glob("*.py")):
        bad = {m for m in _imports(path) if m.startswith(("edgefleet.compiler", "edgefleet.agent", "edgefleet.fleet",
                                                            "edgefleet.engines", "onnx", "openvino", "tensorrt"))}
        assert not bad, (path.name, bad)


def test_a_bad_input_is_one_error_whichever_side_finds_it():
    """The compiler's InputError is a judge InputError: one except clause catches a bad data set or task whether the
    compiler or the judge it gates with found it, and both carry exit code 4."""
    from edgefleet.compiler.errors import CompilerError
    from edgefleet.compiler.errors import InputError as CompilerInputError
    from edgefleet.judge.errors import InputError
    from edgefleet.judge.tasks import parse_task_args
    from edgefleet.protocol.exits import exit_for

    assert issubclass(CompilerInputError, InputError) and issubclass(CompilerInputError, CompilerError)
    try:
        parse_task_args("ctc", "blank=x")
    except InputError as exc:
        assert "must be a number" in str(exc) and exit_for(exc)[0] == 4
    else:
        raise AssertionError("a task argument that is not a number was accepted")
