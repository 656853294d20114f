#!/usr/bin/env bash
# The one prepared run for a session that is lent a GPU (the device tool's `run`, repository root, $OUT set):
# the single-device truth table (benchmarks/gpu_check.py), kernel rates against the cost model
# (benchmarks/gpu_matmul.py), the tests/gpu suite and snapshots at k = 1 against their price
# (benchmarks/snapshot_gpu.py), each under its own time limit, every log under $OUT.
#
# The device machine has its own torch (2.11 when last seen, Python 3.12) and no package index, so Tessera is not
# pip-installed there (its torch pin would refuse that torch): the package is linked onto PYTHONPATH and what the
# image lacks travels as wheels in .whl/ (carry: [".whl"]). Prepare them here, once per session:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     ortools==9.15.6755 immutabledict==4.3.1 protobuf==6.33.6 pydantic==2.14.4 pydantic-core==2.50.5 \
#     annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 torchao==0.18.0 xxhash==4.1.0
#
# (35 MB; ortools pins protobuf, pydantic a newer typing_extensions than the image may hold, torchao runs the fp8
# rows, the runtime imports xxhash for its snapshot files). Then, as one call:
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=580)
# and commit what comes back (gpu-check-cuda-<date>.md/.json, gpu-matmul-<date>.md, snapshot-cuda-<date>.md) to
# benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder the results go to}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels failed"; exit 1; }
fi
mkdir -p /tmp/tessera-path && ln -sfn "$PWD" /tmp/tessera-path/tessera
export PYTHONPATH=/tmp/site:/tmp/tessera-path PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv | tee "$OUT/device.txt"
python3 -c "import sys, torch, tessera.api; torch.cuda.is_available() or sys.exit('no CUDA device: nothing to measure');
print('torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/device.txt" || exit 1
timeout 330 python3 benchmarks/gpu_check.py --out "$OUT" 2>&1 | grep -v USDT | tee "$OUT/gpu_check.log"
timeout 90 python3 benchmarks/gpu_matmul.py --out "$OUT" 2>&1 | tee "$OUT/gpu_matmul.log"
timeout 100 python3 -m pytest -p no:cacheprovider tests/gpu -q -o addopts=-ra 2>&1 | tail -20 \
  | tee "$OUT/pytest-gpu.log"
# last, so that a run past the call's limit still returns everything above: snapshots on the GPU against the price
timeout 60 python3 benchmarks/snapshot_gpu.py --out "$OUT" 2>&1 | tee "$OUT/snapshot_gpu.log"
