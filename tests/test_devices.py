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
