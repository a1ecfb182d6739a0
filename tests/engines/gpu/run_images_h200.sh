#!/usr/bin/env bash
# GPU image path on the H200 (device tool), writing under $OUT: export.log, pytest.log
# (gpu tests of the image path and the torch backend), ceiling.log (scripts/gpu_image_ceiling.py).
# Needs, carried: .whl (onnx2torch, pytest-asyncio, msgpack), .out/frames and .out/cam
# (scripts/make_image_frames.py). Usage: bash tests/engines/gpu/run_images_h200.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD ENGINES_GPU_REPORT_DIR=$OUT IMAGES_GPU_FRAMES=.out/frames
{ nvidia-smi -L; python3 -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)"
  time python3 scripts/export_resnet50.py -o models-perf/resnet50.onnx; } > "$OUT/export.log" 2>&1
timeout "${PYTEST_S:-170}" python3 -m pytest -c tests/engines/gpu/pytest-h200.ini --rootdir . -rA \
  -W ignore::UserWarning -W ignore::DeprecationWarning -W ignore::FutureWarning \
  tests/engines/gpu/test_images_gpu.py tests/engines/gpu/test_torch_gpu.py \
  > "$OUT/pytest.log" 2>&1
echo "pytest exit $?" >> "$OUT/pytest.log"
timeout "${CEILING_S:-100}" python3 scripts/gpu_image_ceiling.py --frames .out/cam \
  --duration-s 1.5 --repeats 3 > "$OUT/ceiling.log" 2>&1
echo "ceiling exit $?" >> "$OUT/ceiling.log"
tail -4 "$OUT/export.log"; grep -E "REPORT|PASSED|FAILED|ERROR|passed|failed|exit" "$OUT/pytest.log" | tail -40
cat "$OUT/ceiling.log" | tail -12
