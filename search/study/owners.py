"""Who runs a trial: the worker id (host with its process-ID namespace, and pid) recorded on every trial, and whether
the process behind a recorded id is gone from this machine (latentsweep.search.study.worker fails such a trial at once)."""
from __future__ import annotations

import os
import socket

import optuna

from latentsweep.search.study.contract import OWNER_ATTR


def _this_machine() -> str:
    """The host name and, where the system has them, the process-ID namespace (two containers may share a host name
    but never their process IDs): a pid read from a trial means a process here only when this matches."""
    try:
        space = os.readlink("/proc/self/ns/pid").removeprefix("pid:")  # e.g. "[4026531836]"
    except OSError:  # not Linux
        space = ""
    return f"{socket.gethostname()}{space}"


def worker_id(pid: int | None = None) -> str:
    """Who runs a trial (host:pid, the host with its process-ID namespace): a launcher reaps the trials of a child it
    saw die, and any worker on the same machine the trials of a process that is gone, without waiting for the
    grace."""
    return f"{_this_machine()}:{pid or os.getpid()}"


def gone(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether `trial` was run by a process of this machine that no longer runs it: no process has its pid, the
    process is a zombie (dead, not yet waited for), or it started after the trial (its pid was reused)."""
    import psutil  # only when reaping: the worker's start does not pay for it

    host, _, pid = str(trial.user_attrs.get(OWNER_ATTR, "")).rpartition(":")
    if host != _this_machine() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        proc = psutil.Process(int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        started = trial.datetime_start.timestamp() if trial.datetime_start else None
        return started is not None and proc.create_time() > started
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # not ours to look at: the heartbeat's grace decides
        return False
