"""A Ctrl-C whose KeyboardInterrupt Python drops (raised inside a finalizer: "Exception ignored in ...") still stops
a study: search.process remembers the signal and the runner asks between epochs and before each claim."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from search.process import interrupt_on, raise_if_interrupted


class SignalledWhileCollected:
    """Sends SIGINT from its finalizer, so the handler's KeyboardInterrupt is raised (and dropped) inside it."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the handler runs here, inside the finalizer


def test_a_swallowed_interrupt_is_raised_again_at_the_next_check(monkeypatch):
    dropped = []  # what Python hands to sys.unraisablehook ("Exception ignored in ...") instead of raising it
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    with interrupt_on(signal.SIGINT):
        raise_if_interrupted()  # nothing received yet
        SignalledWhileCollected()  # collected at once: its KeyboardInterrupt is dropped
        assert dropped == [KeyboardInterrupt]
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
    with interrupt_on(signal.SIGINT):
        raise_if_interrupted()  # a new block starts clean
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
