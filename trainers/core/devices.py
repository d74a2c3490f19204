"""Device names (auto, cpu, cuda, cuda:N): read from their text and checked against this machine's CUDA devices; the
cores this process may run on."""
from __future__ import annotations

import os
import re

import torch

from latentsweep.trainers.core.errors import LatentsweepError

# What train.device and `pick --device` accept besides auto (torch.device parses far more, e.g. 'meta' or 'xla').
# The ordinal is read from the text, never from torch.device: torch keeps it in 8 bits (c10::DeviceIndex is an
# int8_t), so torch.device("cuda:999").index is -25 and torch.device("cuda:256").index is 0, which would pass a
# range check or silently mean GPU 0.
DEVICE_NAME = re.compile(r"cpu|cuda(?::(?P<index>0|[1-9][0-9]*))?")
# The variable the CUDA driver reads, once, when it initialises: which of the machine's GPUs a process sees.
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def check_device(name: str, cuda_count: int) -> None:
    """One-line LatentsweepError unless `name` is auto, cpu, cuda or cuda:N with N below `cuda_count` (the CUDA
    devices this process sees; 0 when it sees none)."""
    match = DEVICE_NAME.fullmatch(name) if name != "auto" else None
    if name != "auto" and match is None:
        raise LatentsweepError(f"device '{name}' is not one of auto, cpu, cuda, cuda:N")
    if name in ("auto", "cpu"):
        return
    if cuda_count < 1:
        raise LatentsweepError(f"device '{name}' but no CUDA device is available{visible_note()}")
    index = match.group("index")
    if index is not None and int(index) >= cuda_count:
        raise LatentsweepError(f"device '{name}' but this machine has {cuda_count} CUDA device(s) "
                               f"(cuda:0 to cuda:{cuda_count - 1}){visible_note()}")


def visible_note() -> str:
    """' (CUDA_VISIBLE_DEVICES=...)' when the variable is set, else '': said with a count of CUDA devices, since it
    decides which of the machine's GPUs this process sees ('' or a wrong entry hides them all)."""
    visible = os.environ.get(VISIBLE_ENV)
    return "" if visible is None else f" ({VISIBLE_ENV}={visible!r})"


def cuda_count() -> int:
    """The CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str) -> torch.device:
    """auto | cpu | cuda | cuda:N as a torch device that exists on this machine (one-line error otherwise)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device(name, cuda_count() if name != "cpu" else 0)
    match = DEVICE_NAME.fullmatch(name)
    index = match.group("index")
    return torch.device("cuda", int(index)) if index is not None else torch.device(name)


def machine_gpu(device: torch.device, visible: str | None = None) -> str:
    """What a trial records as its device: 'cpu', or 'cuda:K' with K the machine's GPU (the entry of
    CUDA_VISIBLE_DEVICES the process's ordinal points at, so two workers pinned to GPUs 0 and 1 record different
    devices although each trains on its own cuda:0)."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get(VISIBLE_ENV) if visible is None else visible
    entries = [e.strip() for e in visible.split(",")] if visible else []
    return f"cuda:{entries[index]}" if index < len(entries) else f"cuda:{index}"


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's limit), at least 1; all of the
    machine's where the system has no affinity call."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
