"""The engine-level decode + infer ceiling of camera JPEGs (``bench.common.decode_infer_ceiling``)
with a chosen ``engines`` package, for a before/after in one device call (issue 17).

Usage, on the GPU host with the benchmark's wheels on ``PYTHONPATH``::

    python scripts/decode_ceiling_ab.py ROOT LABEL [STREAMS INFLIGHT SECONDS]

``ROOT`` is the folder whose ``engines`` package is measured (``.`` for this tree; a
``git archive OLD engines`` unpacked elsewhere for the tree before a change). Prints one JSON
line: images/s, CPU µs per image, NVML's GPU busy and the executor's shape.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 5):
        print(__doc__, file=sys.stderr)
        return 2
    root, label = argv[0], argv[1]
    streams, inflight, seconds = (int(argv[2]), int(argv[3]), float(argv[4])) \
        if len(argv) == 5 else (2, 4, 4.0)
    sys.path.insert(0, root)
    import engines
    from bench.common import decode_infer_ceiling
    from bench.models import DEFAULT_REPO, ensure_resnet50
    from bench.workloads import workload

    ensure_resnet50(DEFAULT_REPO)
    wl = workload("resnet50-jpeg", run="ab", models_dir=DEFAULT_REPO)
    res = decode_infer_ceiling(wl, "torch", 64, seconds, inflight=inflight, streams=streams)
    print(json.dumps({"label": label, "engines": engines.__file__, **(res or {})}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
