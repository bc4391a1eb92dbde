"""The garbage collector's settings for services (L{kcoral.heap})."""

from __future__ import annotations

import gc

import pytest

from kcoral.heap import YOUNG_THRESHOLD, SettledHeap


@pytest.fixture
def restored_gc():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_a_started_service_freezes_what_exists_and_collects_less_often(restored_gc):
    """A started SettledHeap freezes what exists and raises the young threshold; new cycles still go."""
    older, oldest = gc.get_threshold()[1:]
    before = gc.get_freeze_count()
    heap = SettledHeap()
    heap.startService()
    assert heap.running
    assert gc.get_freeze_count() > before
    assert gc.get_threshold() == (YOUNG_THRESHOLD, older, oldest)
    # What is made afterwards is collected as usual.
    cycle = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1
