"""The judge: how a built engine is judged against FP32, shared by the compiler's gate and ``edgefleet verify``.

Installed as ``edgefleet.judge`` (the folder judge/ in the repository). Owned by neither side: the compiler gates a
build with it and the agent's ``verify`` judges the same bundle on a device with it, so a bundle is checked on a
device exactly as it was gated at build time. numpy, PyYAML (task files) and the protocol only; OpenCV lazily (image
folders, a segmentation map's objects); never onnx, onnxruntime's quantizer or any runtime.

- :mod:`edgefleet.judge.data`: calibration and evaluation sets (``.npz``, ``.npy``, folders of images);
- :mod:`edgefleet.judge.predict`: an engine's outputs over a data set;
- :mod:`edgefleet.judge.tasks`: what a model is for (declared, from ``MODEL.task.yaml`` or inferred) and the task's
  criteria;
- :mod:`edgefleet.judge.gate`: the verdict (top-1 against labels, agreement with FP32, or the task's criteria);
- :mod:`edgefleet.judge.errors`: what the judge raises.
"""
