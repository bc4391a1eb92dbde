"""
What poll mode does with two reads of the repository: the models gone, and
those new or changed, whatever the reads hold.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kcoral.server.control import changes

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
