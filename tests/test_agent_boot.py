"""An agent whose committed model cannot be loaded falls back to the previous one and serves it."""

import io
import json
import tarfile

import httpx

from tests.agent_harness import preinstall, running_agent


def _retarget(bundle, out, **changes):
    with tarfile.open(bundle) as src, tarfile.open(out, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            if m.name == "manifest.json":
                doc = json.loads(data)
                doc.update(changes)
                data = json.dumps(doc).encode()
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    return out


def test_unloadable_current_model_falls_back_to_previous(tmp_path, digits_bundle):
    unloadable = _retarget(digits_bundle, tmp_path / "trt.tar", version="2.0.0", backend="tensorrt")
    data = tmp_path / "agent"
    preinstall(data, digits_bundle)
    preinstall(data, unloadable)  # committed, but this agent has no TensorRT backend
    with running_agent(data) as (agent, url):
        assert httpx.get(f"{url}/v2/health/ready").status_code == 200
        assert httpx.get(f"{url}/v2/models/digits").json()["versions"] == ["1.0.0"]
        assert agent.store.current.installed.version == "1.0.0"
    state = json.loads((data / "store" / "state.json").read_text())
    assert state["current"]["installed"]["version"] == "1.0.0"
