#!/usr/bin/env bash
# Fetch Triton's Performance Analyzer (perf_analyzer) into a cache and print the path of a wrapper that runs it.
#
#   bench/perf_analyzer.sh            -> ~/.cache/edgefleet/perf_analyzer/perf_analyzer (fetched once)
#   "$(bench/perf_analyzer.sh)" -m digits -u 127.0.0.1:8000 -i http --concurrency-range 1:4
#
# The binary comes from the tritonclient 2.41.0 wheel (tritonclient-2.41.0.data/data/bin/perf_analyzer; newer wheels
# no longer carry it, and the 'perf-analyzer' name on the index is a placeholder). It loads libb64.so.0d (Debian's
# libb64-0d, .ci/ensure-system-deps) and libcudart.so.12 even for CPU-only use: the latter from the
# nvidia-cuda-runtime-cu12 wheel, which the wrapper puts on LD_LIBRARY_PATH. Exit status 1 with the reason on
# stderr when something cannot be fetched. CACHE overrides the folder; PYTHON the interpreter whose pip downloads.
set -euo pipefail
dir="${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgefleet/perf_analyzer}"
py="${PYTHON:-python3}"
wrapper="$dir/perf_analyzer"
if [ ! -x "$wrapper" ] || [ ! -f "$dir/lib/libcudart.so.12" ] || [ ! -x "$dir/bin/perf_analyzer" ]; then
  mkdir -p "$dir/wheels" "$dir/bin" "$dir/lib"
  "$py" -m pip download -q --no-deps tritonclient==2.41.0 --only-binary :all: --platform manylinux1_x86_64 \
    -d "$dir/wheels" >&2
  "$py" -m pip download -q --no-deps 'nvidia-cuda-runtime-cu12<13' --only-binary :all: \
    --platform manylinux2014_x86_64 -d "$dir/wheels" >&2
  "$py" - "$dir" <<'PY'
import glob, os, sys, zipfile
d = sys.argv[1]
for pattern, member, target in (("tritonclient-2.41.0-*.whl", "tritonclient-2.41.0.data/data/bin/perf_analyzer",
                                 "bin/perf_analyzer"),
                                ("nvidia_cuda_runtime_cu12-*.whl", "nvidia/cuda_runtime/lib/libcudart.so.12",
                                 "lib/libcudart.so.12")):
    wheels = sorted(glob.glob(os.path.join(d, "wheels", pattern)))
    if not wheels:
        sys.exit(f"no wheel matching {pattern} in {d}/wheels")
    with zipfile.ZipFile(wheels[-1]) as z, open(os.path.join(d, target), "wb") as out:
        out.write(z.read(member))
    os.chmod(os.path.join(d, target), 0o755)
PY
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s/bin/perf_analyzer" "$@"\n' \
    "$dir" "$dir" > "$wrapper.tmp"
  chmod 755 "$wrapper.tmp"
  mv "$wrapper.tmp" "$wrapper"
fi
echo "$wrapper"
