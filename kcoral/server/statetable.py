"""
The states of a sequence model's live sequences, kept on its device: one
table a state tensor, one row a slot, and a step that gathers the rows of
the sequences it runs and runs the model on them (one execution), then
scatters their new states back into the tables, given up to it so that it
writes them in place (another). A step's state never crosses to the host;
only its controls, inputs and outputs do. Two executions, not one: XLA
copies a whole table that one execution both reads and writes in place,
which costs a step the size of every live sequence's state.

A table has a row more than its slots, a scratch row that a batch's
padding rows read and write, so that padding needs no slot of its own. It
grows (doubling, on the device) when a slot past its rows is asked for.

Everything here blocks (JAX): a worker calls L{StateTable.run} on a worker
thread, one step at a time for a table, never from the reactor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kcoral.models.manifest import ModelManifest
from kcoral.server.invariant import COUNT_DTYPE

#: The slots a table starts with.
FIRST_CAPACITY = 16


class StateTable:
    """
    The live sequences' states of the sequence model of C{manifest} (with
    its configuration's batch sizes), on C{device}. C{calls} are its
    program for each batch size, C{call(*params, *state, *controls,
    *inputs)} returning its new state then its outputs; with C{counted},
    the one call, for C{max_batch_size} rows, takes the count of real rows
    last (batch invariant). C{initial} is one sequence's starting state.
    """

    def __init__(self, manifest: ModelManifest, calls: Mapping[int, Callable], params: Sequence,
                 initial: Sequence[np.ndarray], device, *, counted: bool = False,
                 capacity: int = FIRST_CAPACITY):
        import jax

        assert manifest.sequence is not None
        self.manifest = manifest
        self._sequence = manifest.sequence
        self._params = tuple(params)
        self._device = device
        self._counted = counted
        self._initial = tuple(jax.device_put(list(initial), device))
        self._capacity = capacity
        self._tables = self._empty(capacity)
        self._steps = {size: jax.jit(_step(call, len(self._sequence.state)))
                       for size, call in calls.items()}
        # The tables are given up to the write, which puts the new rows in place.
        self._write = jax.jit(_write, donate_argnums=0)

    @property
    def capacity(self) -> int:
        """The slots its tables hold now (they grow as slots are asked for)."""
        return self._capacity

    def _empty(self, capacity: int) -> list:
        import jax
        import jax.numpy as jnp

        return [jax.device_put(jnp.zeros((capacity + 1, *spec.shape[1:]), spec.dtype),
                               self._device) for spec in self._sequence.state]

    def warm(self) -> None:
        """Compile its step for every batch size it runs (a slot's state is
        written by a step that starts it, so the scratch row's writes here
        touch no sequence)."""
        for size in self._steps:
            self._execute(size, [self._capacity] * size, [False] * size, {},
                          [np.zeros((size, *shape[1:]), dtype) for spec in self.manifest.inputs
                           for dtype, shape in spec.program_tensors], 0)

    def run(self, slots: Sequence[int], starts: Sequence[bool],
            controls: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray]
            ) -> dict[str, np.ndarray]:
        """
        One step of the sequences in C{slots} (distinct), a row each: a row
        that C{starts} its sequence from the initial state, the others from
        their slot's; C{controls} and C{inputs} by name, a row a slot. Their
        new states are kept in their slots; their outputs returned by name.
        """
        rows = len(slots)
        size = min(s for s in self._steps if s >= rows)
        if max(slots) >= self._capacity:
            self._grow(max(slots) + 1)
        return self._execute(size, slots, starts, controls,
                             [array for spec in self.manifest.inputs
                              for array in spec.to_program(inputs[spec.name])], rows)

    def _execute(self, size: int, slots: Sequence[int], starts: Sequence[bool],
                 controls: Mapping[str, np.ndarray], inputs: list[np.ndarray], rows: int
                 ) -> dict[str, np.ndarray]:
        pad = size - len(slots)
        # Padding rows read and write the scratch row; their READY is 0.
        slot_rows = np.array([*slots, *[self._capacity] * pad], np.int32)
        start_rows = np.array([*starts, *[False] * pad], np.bool_)
        control_rows = [_padded(controls.get(spec.name, np.zeros((len(slots), 1), spec.dtype)), size)
                        for spec in self._sequence.controls]
        count = [COUNT_DTYPE(rows)] if self._counted else []
        try:
            new, outputs = self._steps[size](self._tables, slot_rows, start_rows, self._params,
                                             self._initial, *control_rows,
                                             *[_padded(x, size) for x in inputs], *count)
            self._tables = self._write(self._tables, slot_rows, new)
        except Exception:
            if any(table.is_deleted() for table in self._tables):
                # Given up to a step that failed: every slot's state is lost.
                self._tables = self._empty(self._capacity)
                raise StateLost() from None
            raise
        returned = iter(outputs)
        return {spec.name: spec.from_program([np.asarray(next(returned))[:len(slots)]
                                              for _ in spec.program_tensors])
                for spec in self.manifest.outputs}

    def _grow(self, needed: int) -> None:
        """Tables of at least C{needed} slots, the rows held kept (on the device)."""

        capacity = self._capacity
        while capacity < needed:
            capacity *= 2
        grown = []
        for table, fresh in zip(self._tables, self._empty(capacity)):
            grown.append(fresh.at[:self._capacity].set(table[:self._capacity]))
        self._tables, self._capacity = grown, capacity


def _step(call: Callable, held: int) -> Callable:
    """The step of C{call}, a program whose first C{held} outputs are its
    new state: gather the rows' states (the initial one for a starting
    row), run; the new states, and the outputs."""

    def step(tables, slots, starts, params, initial, *rest):
        import jax.numpy as jnp

        state = [jnp.where(starts.reshape(-1, *[1] * (table.ndim - 1)), first, table[slots])
                 for table, first in zip(tables, initial)]
        returned = call(*params, *state, *rest)
        return returned[:held], returned[held:]

    return step


def _write(tables, slots, new):
    """The tables with each of C{new}'s rows at its slot."""
    return [table.at[slots].set(rows) for table, rows in zip(tables, new)]


class StateLost(Exception):
    """A step failed after its tables were given up to it: every live
    sequence's state is gone."""


def _padded(array: np.ndarray, size: int) -> np.ndarray:
    """C{array} with zero rows up to C{size}."""
    return np.pad(array, [(0, size - len(array))] + [(0, 0)] * (array.ndim - 1))
