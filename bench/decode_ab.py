"""A/B of the engine-level decode + infer ceiling (sixth session, issue 17):
python .before/ab.py ROOT LABEL [STREAMS INFLIGHT SECONDS]; ROOT holds the `engines` package
measured (.before: the tree before the change; $PWD: after)."""
import json
import sys

root, label = sys.argv[1], sys.argv[2]
streams, inflight, seconds = (int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])) \
    if len(sys.argv) > 5 else (2, 4, 4.0)
sys.path.insert(0, root)
import engines  # noqa: E402
from bench.common import decode_infer_ceiling  # noqa: E402
from bench.models import DEFAULT_REPO, ensure_resnet50  # noqa: E402
from bench.workloads import workload  # noqa: E402

ensure_resnet50(DEFAULT_REPO)
wl = workload("resnet50-jpeg", run="ab", models_dir=DEFAULT_REPO)
res = decode_infer_ceiling(wl, "torch", 64, seconds, inflight=inflight, streams=streams)
print(json.dumps({"label": label, "engines": engines.__file__, **(res or {})}), flush=True)
