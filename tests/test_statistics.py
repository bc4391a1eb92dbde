"""
Model statistics in the form of Triton's statistics extension: what a
worker counts (on a fake clock), and the sum a gateway or a Router answers.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock

from kcoral.models.statistics import INFERENCE_DURATIONS, Statistics, summed


def test_a_worker_counts_rows_requests_and_executions():
    """Rows count inferences, a batch one execution, each request its durations in nanoseconds."""
    clock = Clock()
    clock.advance(1700000000.5)
    stats = Statistics(clock)
    stats.of("m", "1").add("queue", 0.002)
    stats.of("m", "1").add("queue", 0.001)
    stats.executed("m", "1", size=5, requests=2, seconds=0.01)
    stats.answered("m", "1", ok=True, seconds=0.02, rows=3)
    stats.answered("m", "1", ok=True, seconds=0.03, rows=2)
    stats.answered("m", "1", ok=False, seconds=0.5, rows=0)
    [m] = stats.to_json([("m", "1")])
    assert (m["name"], m["version"], m["inference_count"], m["execution_count"]) == ("m", "1", 5, 1)
    assert m["last_inference"] == 1700000000500
    s = m["inference_stats"]
    assert s["success"] == {"count": 2, "ns": 50_000_000}
    assert s["fail"] == {"count": 1, "ns": 500_000_000}
    assert s["queue"] == {"count": 2, "ns": 3_000_000}
    assert s["compute_infer"] == {"count": 2, "ns": 20_000_000}
    assert m["batch_stats"] == [{"batch_size": 5, "compute_input": {"count": 0, "ns": 0},
                                 "compute_infer": {"count": 1, "ns": 10_000_000},
                                 "compute_output": {"count": 0, "ns": 0}}]


def test_a_model_never_used_has_zeros():
    """A served model that answered nothing is listed with every count zero."""
    [m] = Statistics(Clock()).to_json([("idle", "2")])
    assert m["inference_count"] == m["execution_count"] == m["last_inference"] == 0
    assert set(m["inference_stats"]) == set(INFERENCE_DURATIONS)
    assert m["batch_stats"] == []


counts = st.integers(0, 10**12)
durations = st.fixed_dictionaries({"count": counts, "ns": counts})
models = st.lists(st.fixed_dictionaries({
    "name": st.sampled_from(["a", "b"]), "version": st.sampled_from(["1", "2"]),
    "last_inference": counts, "inference_count": counts, "execution_count": counts,
    "inference_stats": st.fixed_dictionaries(dict.fromkeys(INFERENCE_DURATIONS, durations)),
    "batch_stats": st.lists(st.fixed_dictionaries({
        "batch_size": st.integers(1, 4), "compute_infer": durations}), max_size=3),
}), max_size=4)


@given(st.lists(models, max_size=4))
def test_the_sum_of_members_does_not_depend_on_how_they_are_grouped(answers):
    """Summing members' statistics in any grouping gives the same totals, one entry a model version."""
    whole = summed(answers)
    halves = summed([summed(answers[:2]), summed(answers[2:])])
    assert whole == halves
    keys = [(m["name"], m["version"]) for m in whole]
    assert keys == sorted(set(keys))
    for m in whole:
        mine = [x for a in answers for x in a if (x["name"], x["version"]) == (m["name"], m["version"])]
        assert m["inference_count"] == sum(x["inference_count"] for x in mine)
        assert m["last_inference"] == max(x["last_inference"] for x in mine)
        for d in INFERENCE_DURATIONS:
            assert m["inference_stats"][d]["ns"] == sum(x["inference_stats"][d]["ns"] for x in mine)
