"""Fetch Apache Kafka's jars into the cache (``make kafka-jars``); prints the jar directory.

The worker and the tests fetch them on first use anyway; CI calls this from its install step so
that the download is not counted in a test's time.
"""

from __future__ import annotations

import sys

from streamapp.exceptions import BrokerError
from streamapp.kafka_server import ensure_kafka_jars

if __name__ == "__main__":
    try:
        print(ensure_kafka_jars())
    except BrokerError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
