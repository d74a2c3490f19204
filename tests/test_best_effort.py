"""latentsweep.search.failures.best_effort: our bug raised with its traceback, any other failure one line and the caller
goes on."""
from __future__ import annotations

import traceback

import pytest

from latentsweep.search.failures import Kind, StoreFailed, best_effort
from latentsweep.trainers.core.progress import progress_to


def _said(block) -> tuple[list[str], object]:
    lines: list[str] = []
    with progress_to(lines.append):
        attempt = block()
    return lines, attempt


def test_a_store_or_disk_failure_is_one_line_and_the_code_after_runs():
    after = []

    def block():
        with best_effort("log the pick's files to its MLflow run") as attempt:
            raise StoreFailed("http://user:secret@mlflow:5000 refused the connection")
        after.append("ran")
        return attempt

    lines, attempt = _said(block)
    assert after == ["ran"] and attempt.failure.kind is Kind.OUTAGE
    assert lines == ["could not log the pick's files to its MLflow run "
                     "(http://user:***@mlflow:5000 refused the connection)"]  # one line, the password hidden
    lines, attempt = _said(lambda: _disk_full())
    assert lines == ["could not write the report (/x/report.csv: No space left on device)"]
    assert attempt.failure.kind is Kind.MACHINE


def _disk_full():
    with best_effort("write the report") as attempt:
        raise OSError(28, "No space left on device", "/x/report.csv")
    return attempt


def test_our_bug_is_raised_with_its_traceback_and_nothing_is_said():
    def buggy():
        return {}["missing"]

    lines: list[str] = []
    with progress_to(lines.append), pytest.raises(KeyError) as caught:
        with best_effort("refresh the study's MLflow parent run"):
            buggy()
    assert lines == [] and "buggy" in "".join(traceback.format_tb(caught.value.__traceback__))


def test_an_interrupt_goes_through_and_a_finished_block_has_no_failure():
    lines: list[str] = []
    with progress_to(lines.append), pytest.raises(KeyboardInterrupt):
        with best_effort("close the interrupted trial's MLflow run"):
            raise KeyboardInterrupt
    with progress_to(lines.append), best_effort("close it") as attempt:
        pass
    assert lines == [] and attempt.failure is None
