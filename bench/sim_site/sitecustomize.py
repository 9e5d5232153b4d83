"""Imported by Python at start-up when this folder is on PYTHONPATH (bench/sim_runtime.py's ``simulation_env``):
with ``EDGEFLEET_BENCH_SIMULATE`` set, the process (an agent started by bench/serve_sim.py, and the trial processes
it starts) runs its onnxruntime bundles on the simulated runtime. Nothing of this is shipped: the agent has no
hook for it."""

import importlib.util
import os
from pathlib import Path

if os.environ.get("EDGEFLEET_BENCH_SIMULATE"):
    _spec = importlib.util.spec_from_file_location("sim_runtime", Path(__file__).resolve().parent.parent
                                                   / "sim_runtime.py")
    assert _spec is not None and _spec.loader is not None
    _mod = importlib.util.module_from_spec(_spec)
    import sys

    sys.modules["sim_runtime"] = _mod
    _spec.loader.exec_module(_mod)
    _mod.install_from_env()
