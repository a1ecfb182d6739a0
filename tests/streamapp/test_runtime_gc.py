"""freeze_heap: the worker's start-up heap leaves the garbage collector's scans (gc_freeze)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from streamapp.runtime import freeze_heap
from streamapp.settings import Settings


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_heap_moves_live_objects_out_of_the_collected_generations(unfrozen: None) -> None:
    survivors = [[i] for i in range(1000)]  # alive at start-up: never garbage
    assert all(gc.is_tracked(s) for s in survivors)
    freeze_heap()
    assert gc.get_freeze_count() >= len(survivors)
    scanned = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}
    assert not any(id(s) in scanned for s in survivors)
    cycle: list[object] = []
    cycle.append(cycle)  # garbage made after the freeze is still collected
    del cycle
    assert gc.collect() >= 1


def test_gc_freeze_is_on_by_default_and_can_be_turned_off() -> None:
    assert Settings().gc_freeze is True
    assert Settings(gc_freeze=False).gc_freeze is False
