"""The test-only floor of `run --time` ($LATENTSWEEP_TEST_MIN_TIME_S, README's Tests): tests and benchmark smokes of a
one-budget run that needs no pick ask for 20 s instead of waiting out the product's 60-s minimum. It only lowers that
minimum, to a number of seconds below it: anything else leaves parse_duration as it is, and without it nothing
changes."""
from __future__ import annotations

import pytest

from latentsweep.search.pick.onebudget import MIN_TOTAL_S, parse_duration
from latentsweep.search.process import TEST_MIN_TIME_ENV
from latentsweep.trainers.core.errors import LatentsweepError


def test_without_it_the_minimum_is_the_products(monkeypatch):
    monkeypatch.delenv(TEST_MIN_TIME_ENV, raising=False)
    assert parse_duration(f"{MIN_TOTAL_S:.0f}") == MIN_TOTAL_S
    with pytest.raises(LatentsweepError, match=f"at least {MIN_TOTAL_S:.0f} s"):
        parse_duration("20")


def test_it_lowers_the_minimum_and_nothing_else(monkeypatch):
    monkeypatch.setenv(TEST_MIN_TIME_ENV, "20")
    assert parse_duration("20") == 20.0 and parse_duration("90s") == 90.0
    with pytest.raises(LatentsweepError, match="at least 20 s"):
        parse_duration("19")
    with pytest.raises(LatentsweepError, match="over 7 days"):
        parse_duration("1000h")


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon", "", f"{MIN_TOTAL_S + 30:.0f}"])
def test_anything_but_seconds_below_the_minimum_is_ignored(monkeypatch, value):
    """A value that would not shorten a job (zero, negative, not a number, above the minimum) changes nothing."""
    monkeypatch.setenv(TEST_MIN_TIME_ENV, value)
    assert parse_duration(f"{MIN_TOTAL_S:.0f}") == MIN_TOTAL_S
    with pytest.raises(LatentsweepError, match=f"at least {MIN_TOTAL_S:.0f} s"):
        parse_duration(f"{MIN_TOTAL_S - 1:.0f}")
