#!/usr/bin/env bash
# One full GPU run on the H200 (through the device tool), writing everything under $OUT:
#   env.txt         nvidia-smi, versions, ResNet-50 export log
#   pytest.log      the gpu tests (executor, cuda layer, torch backend, digits parity)
#   gpu_reports.json  numbers the tests report (parity, memory before/after close)
#   bench.log, bench.json, bench.png, timeline.png   engines bench, ResNet-50 fp16, torch
# Usage (device tool, carry .whl): bash tests/engines/gpu/run_h200.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/onnx2torch-*.whl .whl/pytest_asyncio-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export ENGINES_GPU_REPORT_DIR=$OUT
{
  date -u; nvidia-smi; python3 --version
  python3 -c "import torch, torchvision, onnx, onnxruntime, numpy, onnx2torch; \
from importlib.metadata import version as v; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version()); \
print('torchvision', torchvision.__version__, 'onnx', onnx.__version__, 'onnxruntime', onnxruntime.__version__, 'numpy', numpy.__version__); \
print('cuda-bindings', v('cuda-bindings'), 'onnx2torch', v('onnx2torch'), 'pytest', v('pytest'))"
  python3 -c "from engines import cuda, available_backends; print(cuda.device_info(), cuda.versions()); print('available backends:', available_backends())"
  nproc
} > "$OUT/env.txt" 2>&1

python3 -m pytest -c tests/engines/gpu/pytest-h200.ini --rootdir . -rA \
  -W ignore::UserWarning -W ignore::DeprecationWarning -W ignore::FutureWarning \
  $(ls -d tests/engines/gpu tests/engines/cuda tests/engines/executor tests/engines/tensorrt 2>/dev/null) \
  > "$OUT/pytest.log" 2>&1
echo "pytest exit $?" >> "$OUT/pytest.log"

python3 scripts/export_resnet50.py -o models-perf/resnet50.onnx >> "$OUT/env.txt" 2>&1

python3 -m engines.cli bench models-perf/resnet50.onnx --backend torch --precision fp16 \
  --batch-sizes 1,8,32,64 --streams 2 --depth 2 --duration-s 3 --warmup-s 0.5 \
  --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/bench.log"
tail -25 "$OUT/bench.log"; tail -15 "$OUT/pytest.log"
