"""The agent stays light: importing it never loads the compiler's or the fleet's dependencies."""

import subprocess
import sys

HEAVY = ("fastapi", "sqlalchemy", "onnx", "amqtt", "sklearn", "compiler", "fleet")


def test_agent_imports_nothing_of_the_compiler_or_the_fleet():
    code = ("import sys, agent.daemon, engines.onnxruntime, edgefleet.cli; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_importing_the_packages_has_no_side_effects():
    code = "import logging, protocol, compiler, fleet, agent, edgefleet; print(len(logging.getLogger().handlers))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"
