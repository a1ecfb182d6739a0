"""``python -m bench.swap`` (the cost of a hot swap) runs and reports every swap."""

from __future__ import annotations

import json
from pathlib import Path

from bench.swap import main


def test_swap_bench_reports_each_swap(tmp_path: Path) -> None:
    out = tmp_path / "swap.json"
    main(["--swaps", "2", "--every-s", "0.4", "--settle-s", "0.2", "--rate", "400",
          "--out", str(out)])
    result = json.loads(out.read_text())
    assert [s["version"] for s in result["swaps"]] == ["2", "1"]
    for swap in result["swaps"]:
        assert swap["load_ms"] > 0 and swap["results"] > 0
        assert swap["device_memory_returned_bytes"] is None  # ONNX Runtime on the CPU
    assert result["baseline"]["results"] > 0
