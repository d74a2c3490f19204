"""Devices: names read from their text and checked against the machine, GPU slots of local workers, the device each
trial records. CUDA is faked by patching torch's device queries, so the CUDA branches run on a CPU machine."""
from __future__ import annotations

import pytest
import torch

from trainers.devices import check_device, machine_gpu, resolve_device
from trainers.errors import LatentsweepError


@pytest.fixture
def one_gpu(monkeypatch):
    """torch reports one CUDA device (and nothing initialises CUDA: resolve_device only asks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_one_gpu_accepts_its_ordinal(one_gpu):
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda:1", "cuda:256", "cuda:999"])
def test_one_gpu_refuses_any_other_ordinal(one_gpu, name):
    # torch.device keeps the ordinal in 8 bits: cuda:999 was index -25 and cuda:256 index 0, both let through
    with pytest.raises(LatentsweepError) as err:
        resolve_device(name)
    message = str(err.value)
    assert "\n" not in message and f"'{name}'" in message and "1 CUDA device(s)" in message


@pytest.mark.parametrize("name", ["cuda:01", "cuda:-1", "gpu", "meta", "cuda:", "CUDA:0", "cuda:1.0"])
def test_names_outside_the_grammar_are_one_line(one_gpu, name):
    with pytest.raises(LatentsweepError, match="is not one of auto, cpu, cuda, cuda:N"):
        resolve_device(name)


def test_no_cuda_refuses_cuda_names(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:0"):
        with pytest.raises(LatentsweepError, match="no CUDA device is available"):
            resolve_device(name)
    assert resolve_device("auto") == torch.device("cpu")


def test_check_device_counts_what_the_process_sees():
    check_device("cuda:3", 4)
    with pytest.raises(LatentsweepError, match="has 4 CUDA device"):
        check_device("cuda:4", 4)


def test_the_recorded_device_is_the_machines_gpu():
    assert machine_gpu(torch.device("cpu")) == "cpu"
    assert machine_gpu(torch.device("cuda", 0), visible="2,3") == "cuda:2"  # pinned to GPU 2: its cuda:0 is GPU 2
    assert machine_gpu(torch.device("cuda", 1), visible="2, 3") == "cuda:3"
    assert machine_gpu(torch.device("cuda", 1), visible="") == "cuda:1"  # not pinned: the ordinal is the GPU


# The caching allocator's words, as a worker on a GPU shared with another process sees them (sizes made up).
SHARED_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
              "1.10 GiB is free. Process 4242 has 70.00 GiB memory in use. Including non-PyTorch memory, this process "
              "has 8.00 GiB memory in use. Of the allocated memory 7.50 GiB is allocated by PyTorch.")


def test_a_gpu_filled_by_other_processes_is_the_machines_fault():
    from search.failures import Kind, classify
    failure = classify(torch.OutOfMemoryError(SHARED_OOM))
    assert failure.kind is Kind.MACHINE and failure.retried and not failure.counts
    assert "\n" not in str(failure.user_error(3)) and "retried" in str(failure.user_error(3))


@pytest.mark.parametrize("message", [
    # alone on the GPU: the config does not fit
    SHARED_OOM.replace("Process 4242 has 70.00 GiB memory in use. ", ""),
    # the other process holds less than was missing: the config would not fit on the GPU alone either
    SHARED_OOM.replace("Tried to allocate 2.00 GiB", "Tried to allocate 75.00 GiB"),
    "CUDA",  # no sizes to read
])
def test_an_oversized_config_stays_a_memory_failure(message):
    from search.failures import Kind, classify
    assert classify(torch.OutOfMemoryError(message)).kind is Kind.MEMORY


@pytest.mark.skipif(not hasattr(torch, "AcceleratorError"), reason="this torch has no AcceleratorError")
def test_an_accelerator_error_is_retried():
    from search.failures import Kind, classify, one_line
    exc = torch.AcceleratorError("CUDA error: unspecified launch failure\nCUDA kernel errors might be reported later")
    failure = classify(exc)
    assert failure.kind is Kind.MACHINE and failure.retried and not failure.counts and not failure.goes_on
    assert one_line(exc) == "AcceleratorError: CUDA error: unspecified launch failure"
