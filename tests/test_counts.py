"""
Counts read from clients (L{kcoral.protocol.counts}): ASCII digits alone,
whatever else Python's C{int()} would take.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcoral.common.report import InvalidReport, parse_models
from kcoral.protocol.counts import MOST_DIGITS, read_count
from kcoral.router.residency import Demand

DIGITS = re.compile(rf"[0-9]{{1,{MOST_DIGITS}}}")

#: What int() takes besides plain digits, or str.isdigit passes.
LOOKALIKES = ["1_0", " 10", "10 ", "+10", "-1", "\t7", "7\n", "١٠", "１０", "²", "0x10", "1e1", "",
              "1.0", "٣", "0_0"]


def _spelled(number: int) -> st.SearchStrategy[str]:
    text = str(number)
    return st.sampled_from([text, f"+{text}", f" {text}", f"{text} ", text.translate(
        str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")), "_".join(text), f"0{text}"])


@given(text=st.one_of(st.text(max_size=40), st.sampled_from(LOOKALIKES),
                      st.integers(0, 10**40).flatmap(_spelled)),
       most=st.integers(0, 10**12))
@settings(max_examples=500, deadline=None)
def test_a_count_is_its_ascii_digits_alone(text, most):
    """Text is a count exactly when it is 1 to 32 ASCII digits within the bound; else none."""
    expected = int(text) if DIGITS.fullmatch(text) and int(text) <= most else None
    assert read_count(text, most) == expected
    if text.isascii():
        assert read_count(text.encode(), most) == expected


@pytest.mark.parametrize("text", LOOKALIKES)
def test_what_int_takes_is_no_count(text):
    """Signs, spaces, underscores and other scripts' digits are no count."""
    assert read_count(text, 10**9) is None


@pytest.mark.parametrize("text", ["1_0", "١", "²", " 1", "+1"])
def test_every_reader_of_a_client_count_refuses_lookalikes(text):
    """An input's size in X-KCoral-Inputs and a worker's reported model version read strictly."""
    digest = "a" * 64
    demand = Demand.of(b"b" * 64, f"{digest}={text}".encode())
    assert demand is not None and demand.inputs == ()
    with pytest.raises(InvalidReport):
        parse_models([{"name": "m", "version": text, "state": "READY"}], "models")
