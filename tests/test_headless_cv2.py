"""One cv2, the headless build: headless Pi and Jetson images have no X11 or GL, and two cv2 builds
(opencv-python beside opencv-python-headless) in one environment overwrite each other's files.

The same on an X11-less ARM sysroot: tests/test_arm64.py (``make test-arm64``).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CV2_DISTS = ("opencv-python", "opencv-python-headless", "opencv-contrib-python", "opencv-contrib-python-headless")
NOT_ON_A_HEADLESS_BOX = re.compile(r"^(libX|libxcb|libICE|libSM|libGL|libEGL|libOpenGL|libglib-2\.0|libgthread-2\.0|"
                                   r"libgobject-2\.0|libgio-2\.0|libgmodule-2\.0)")


def test_the_extras_that_decode_images_name_the_headless_build_only():
    reqs = md.requires("edgefleet") or []
    cv2_reqs = [r for r in reqs if r.lower().startswith("opencv")]
    assert cv2_reqs, reqs
    assert all(r.lower().startswith("opencv-python-headless") for r in cv2_reqs), cv2_reqs
    extras = {m.group(1) for r in cv2_reqs for m in [re.search(r'extra == "([^"]+)"', r)] if m}
    assert {"image", "compiler"} <= extras, cv2_reqs  # the agent's image endpoint: edgefleet[image]


def test_this_environment_holds_one_cv2_and_it_is_headless():
    """``make venv`` installs the dev extra; rapidocr-onnxruntime (which requires opencv-python) goes in
    with --no-deps, so nothing brings the X11 build."""
    have = set()
    for d in md.distributions():
        name = (d.metadata["Name"] or "").lower().replace("_", "-")
        if name in CV2_DISTS:
            have.add(name)
    assert have == {"opencv-python-headless"}, have


def test_cv2_links_no_x11_gl_or_glib():
    ldd = shutil.which("ldd")
    if ldd is None:
        pytest.skip("no ldd here")
    import cv2

    libs = sorted(Path(cv2.__file__).parent.rglob("cv2*.so"))
    assert libs
    for so in libs:
        r = subprocess.run([ldd, str(so)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
        assert "not found" not in r.stdout, r.stdout
        bad = [n for n in names if NOT_ON_A_HEADLESS_BOX.match(n)]
        assert not bad, f"{so} links {bad}"
