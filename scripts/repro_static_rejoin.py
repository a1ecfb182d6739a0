"""Reproduce the embedded broker's static-membership rejoin bug with plain aiokafka consumers.

Two consumers with static group instance ids share an 8-partition topic: ``a`` joins first (the
group leader), then ``b``. ``b`` is SIGKILLed and restarted at once (before its session expires)
with a *different subscription* (one more topic), which changes its JoinGroup metadata as a
restarted Faust worker's does (Faust's assignor puts the member's current assignment into the
metadata). ``--restart-as same`` reuses its instance id, as a worker restarted in place does;
``new`` gives it another static id; ``dynamic`` none, as ``streamapp worker --processes N`` does
for a restarted child. Prints per try whether the restarted member got partitions within
``--wait-s``. docs/scaling.md explains the cause.

Usage::

    python scripts/repro_static_rejoin.py --tries 10 --restart-as same      # the bug
    python scripts/repro_static_rejoin.py --tries 10 --restart-as dynamic   # the supervisor's way

Needs nothing but this package (it starts the embedded broker); about 15-45 s per try.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from streamapp.broker import EmbeddedBroker
from streamapp.kafka import create_topics

# One group member: prints "ASSIGNED <partitions of the first topic>" on each assignment.
MEMBER = r"""
import asyncio, sys
from aiokafka import AIOKafkaConsumer
from aiokafka.abc import ConsumerRebalanceListener
boot, group, instance, *topics = sys.argv[1:]
instance = instance or None
class Listener(ConsumerRebalanceListener):
    def on_partitions_revoked(self, revoked): pass
    def on_partitions_assigned(self, assigned):
        print("ASSIGNED", sorted(p.partition for p in assigned if p.topic == topics[0]),
              flush=True)
async def main():
    c = AIOKafkaConsumer(bootstrap_servers=boot, group_id=group, group_instance_id=instance,
                         session_timeout_ms=6000, heartbeat_interval_ms=1000,
                         rebalance_timeout_ms=6000, request_timeout_ms=30000)
    c.subscribe(topics, listener=Listener())
    await c.start()
    while True:
        await c.getmany(timeout_ms=500)
asyncio.run(main())
"""


def _start(bootstrap: str, group: str, instance: str, topics: list[str], log: Path) -> \
        subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", MEMBER, bootstrap, group, instance, *topics],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )


def _assigned(log: Path, timeout_s: float) -> float | None:
    """Seconds until the member's last assignment holds a partition of the main topic."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        lines = [line for line in log.read_text().splitlines() if line.startswith("ASSIGNED")]
        if lines and lines[-1] != "ASSIGNED []":
            return time.monotonic() - start
        time.sleep(0.2)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--restart-as", choices=("same", "new", "dynamic"), default="dynamic")
    parser.add_argument("--wait-s", type=float, default=30.0)
    args = parser.parse_args()
    ok = 0
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        for attempt in range(args.tries):
            group = f"repro-{uuid.uuid4().hex[:8]}"
            topic, extra = group, f"{group}-extra"
            create_topics(broker.bootstrap_servers, {topic: 8, extra: 1})
            logs = {name: Path(tmp) / f"{attempt}-{name}.log" for name in ("a", "b", "b2")}
            a = _start(broker.bootstrap_servers, group, "a", [topic], logs["a"])
            if _assigned(logs["a"], 60) is None:
                print(f"try {attempt}: member a never got partitions", file=sys.stderr)
            b = _start(broker.bootstrap_servers, group, "b", [topic], logs["b"])
            if _assigned(logs["b"], 60) is None:
                print(f"try {attempt}: member b never got partitions", file=sys.stderr)
            os.killpg(b.pid, signal.SIGKILL)
            b.wait()
            instance = {"same": "b", "new": "b-r1", "dynamic": ""}[args.restart_as]
            b = _start(broker.bootstrap_servers, group, instance, [topic, extra], logs["b2"])
            took = _assigned(logs["b2"], args.wait_s)
            ok += took is not None
            print(f"try {attempt}: restarted member ({instance or 'dynamic'}) got partitions: "
                  f"{'no' if took is None else f'after {took:.1f} s'}", flush=True)
            for proc in (a, b):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    print(f"restarted as {args.restart_as}: {ok}/{args.tries} restarted members got partitions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
