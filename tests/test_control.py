"""
What poll mode does with two reads of the repository: the models gone, and
those new or changed, whatever the reads hold; and a load refused by the
mode, in Triton's words.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock

from kcoral.errors import BadRequest, LoadFailed
from kcoral.inference.grpcmethods import status_code_of
from kcoral.server.control import ModelControl, changes
from kcoral.server.models import ModelRepository

reads = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]),
                        st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=4)


@given(reads, reads)
def test_every_model_is_gone_changed_or_kept(before, after):
    """A model no longer read is gone; one read anew or with another stamp is loaded; the rest kept."""
    gone, changed = changes(before, after)
    assert gone == sorted(set(before) - set(after))
    assert changed == sorted(n for n in after if n not in before or before[n] != after[n])
    kept = set(after) - set(changed)
    assert all(before[n] == after[n] for n in kept)


def test_a_read_like_the_last_changes_nothing():
    """Polling a repository nobody touched loads nothing and drops nothing."""
    read = {"mlp": (("1/model.json", 5, 10),)}
    assert changes(read, dict(read)) == ([], [])
    assert changes({}, read) == ([], ["mlp"])
    assert changes(read, {}) == (["mlp"], [])


@pytest.mark.parametrize("mode", ["none", "poll"])
def test_a_load_the_mode_refuses_fails_in_tritons_words(tmp_path, mode):
    """Outside explicit mode a load fails at once: 400 (gRPC INTERNAL), its message starting
    "failed to load 'NAME'" and naming the option; an unload is a plain 400."""
    control = ModelControl(ModelRepository(tmp_path), mode=mode, load_models=(), poll_seconds=1.0,
                           device=lambda: None, reactor=Clock())
    failures: list = []
    control.load("mlp").addErrback(failures.append)
    [failure] = failures
    error = failure.value
    assert isinstance(error, LoadFailed) and error.status == 400
    assert status_code_of(error) == grpc.StatusCode.INTERNAL
    assert error.message == (f"failed to load 'mlp': models are not loaded on request in model "
                             f"control mode '{mode}': start with --model-control-mode explicit")
    with pytest.raises(BadRequest) as refused:
        control.unload("mlp")
    assert type(refused.value) is BadRequest and "--model-control-mode explicit" in refused.value.message
