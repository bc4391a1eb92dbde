"""
Per-model statistics in the form of Triton's statistics extension, which
perf_analyzer reads to split a request's time into queue and compute:
counted by the worker that does the work (L{Statistics}), and summed over
members by a gateway or a Router (L{summed}).

Durations are cumulative nanoseconds with their counts, as Triton keeps
them: C{success} and C{fail} the whole time of each request the worker
answered, C{queue} each request's wait for its batch to start,
C{compute_input} reading its tensors, C{compute_infer} the execution of its
batch, C{compute_output} writing its answer. C{inference_count} counts
rows, C{execution_count} executions (one for a whole batch), and
C{batch_stats} each executed batch size's compute times.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

#: The durations of C{inference_stats}, in Triton's order.
INFERENCE_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer",
                       "compute_output")
#: The durations of each entry of C{batch_stats}.
BATCH_DURATIONS = ("compute_input", "compute_infer", "compute_output")


def _ns(seconds: float) -> int:
    return max(int(seconds * 1e9), 0)


def _zero(names: tuple[str, ...]) -> dict[str, dict[str, int]]:
    return {name: {"count": 0, "ns": 0} for name in names}


@attrs.define
class ModelStatistics:
    """One version of one model's counts, as Triton's C{ModelStatistics} message."""

    name: str
    version: str
    #: When it last answered an inference, in milliseconds since the epoch.
    last_inference: int = 0
    inference_count: int = 0
    execution_count: int = 0
    inference_stats: dict[str, dict[str, int]] = attrs.Factory(lambda: _zero(INFERENCE_DURATIONS))
    #: Each executed batch size's compute durations.
    batches: dict[int, dict[str, dict[str, int]]] = attrs.Factory(dict)

    def add(self, duration: str, seconds: float, count: int = 1) -> None:
        entry = self.inference_stats[duration]
        entry["count"] += count
        entry["ns"] += _ns(seconds) * count

    def add_batch(self, size: int, duration: str, seconds: float) -> None:
        entry = self.batches.setdefault(size, _zero(BATCH_DURATIONS))[duration]
        entry["count"] += 1
        entry["ns"] += _ns(seconds)

    def to_json(self) -> dict:
        return {"name": self.name, "version": self.version, "last_inference": self.last_inference,
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "inference_stats": {k: dict(v) for k, v in self.inference_stats.items()},
                "batch_stats": [{"batch_size": size, **{k: dict(v) for k, v in stats.items()}}
                                for size, stats in sorted(self.batches.items())]}


class Statistics:
    """The statistics of one worker's models; C{clock} gives the wall time."""

    def __init__(self, clock):
        self._clock = clock
        self._models: dict[tuple[str, str], ModelStatistics] = {}

    def of(self, name: str, version: str) -> ModelStatistics:
        key = (name, version)
        stats = self._models.get(key)
        if stats is None:
            stats = self._models[key] = ModelStatistics(name, version)
        return stats

    def answered(self, name: str, version: str, *, ok: bool, seconds: float, rows: int) -> None:
        """A request was answered after C{seconds}: with C{rows} rows of outputs, or failed."""
        stats = self.of(name, version)
        stats.add("success" if ok else "fail", seconds)
        if ok:
            stats.inference_count += rows
            stats.last_inference = int(self._clock.seconds() * 1000)

    def executed(self, name: str, version: str, *, size: int, requests: int,
                 seconds: float) -> None:
        """One execution of C{size} rows took C{seconds}, for C{requests} requests."""
        stats = self.of(name, version)
        stats.execution_count += 1
        stats.add("compute_infer", seconds, requests)
        stats.add_batch(size, "compute_infer", seconds)

    def to_json(self, served: Iterable[tuple[str, str]]) -> list[dict]:
        """The statistics of the models C{served} (name, version), zero for one never used."""
        return [self.of(name, version).to_json() for name, version in sorted(served)]


def _add(into: dict[str, dict[str, int]], more: dict) -> None:
    for name, entry in into.items():
        given = more.get(name) or {}
        entry["count"] += int(given.get("count", 0))
        entry["ns"] += int(given.get("ns", 0))


def summed(answers: Iterable[list[dict]]) -> list[dict]:
    """The statistics of several members' answers, model by model (name and
    version): counts and durations summed, the latest last inference."""
    total: dict[tuple[str, str], ModelStatistics] = {}
    for answer in answers:
        for model in answer:
            key = (str(model["name"]), str(model["version"]))
            stats = total.setdefault(key, ModelStatistics(*key))
            stats.last_inference = max(stats.last_inference, int(model.get("last_inference", 0)))
            stats.inference_count += int(model.get("inference_count", 0))
            stats.execution_count += int(model.get("execution_count", 0))
            _add(stats.inference_stats, model.get("inference_stats") or {})
            for batch in model.get("batch_stats") or []:
                _add(stats.batches.setdefault(int(batch["batch_size"]), _zero(BATCH_DURATIONS)),
                     batch)
    return [total[key].to_json() for key in sorted(total)]
