"""``python -m bench.record_batches`` runs and prints one row per workload with its ratio."""

from __future__ import annotations

import pytest

from bench import record_batches


def test_it_prints_each_workload_with_both_costs_and_their_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    record_batches.main(["--seconds", "0.01", "--fetch-bytes", "700000"])

    lines = capsys.readouterr().out.splitlines()
    assert "ratio" in lines[0]
    rows = {line[:32].strip(): line[32:].split() for line in lines[1:]}
    assert set(rows) == {name for name, _, _ in record_batches.CASES}
    for ours, theirs, ratio in rows.values():
        assert float(ours) > 0 and float(theirs) > 0
        assert float(ratio) == pytest.approx(float(theirs) / float(ours), rel=0.02)
