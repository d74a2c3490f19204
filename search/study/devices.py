"""GPU slots of local workers: the GPUs `--gpus` names, what `--workers auto` means, and the one GPU each spawned
worker sees (its own CUDA_VISIBLE_DEVICES, set before its first CUDA call)."""
from __future__ import annotations

import argparse
import fcntl
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from latentsweep.search.checks import check_count
from latentsweep.trainers.core.devices import VISIBLE_ENV, usable_cores, visible_note
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.train.population import MAX_POPULATION

ALL = "all"
AUTO = "auto"
# `--workers auto` on a machine without GPUs: one worker per this many cores, the threads each compose worker gets by
# default (WORKER_THREADS in docker-compose.yml), so auto never asks for more threads than the machine has.
CPU_THREADS_PER_WORKER = 2
# `--gpus`/`--per-gpu` when not given: so that compose's worker replicas, which share one command, get them from .env.
GPUS_ENV, PER_GPU_ENV = "LATENTSWEEP_GPUS", "LATENTSWEEP_PER_GPU"
SLOT_FILE_CHARS = re.compile(r"[^A-Za-z0-9._-]")  # a GPU's UUID or MIG name may hold '/' or ':'
HELD: list[int] = []  # the lock files of this process's claimed slots, open (so locked) until it exits
# What a spawned worker holds before it reads any data: 305 MB (ru_maxrss of a process importing
# latentsweep.search.study.runner, torch 2.13's CPU build, 2026-11-27). More local workers (or slots per GPU) than the
# machine's memory holds at that size can never all start: such a count is a typo, refused before any is spawned.
WORKER_START_BYTES = 300 * 2**20
# Worker slots per GPU when no device option is given: one per CPU_THREADS_PER_WORKER cores of the GPU's share, at
# most this many. A step at challenge size is launch-bound (the host's Python and kernel launches, not the card), so
# worker processes on one card add trials while each has cores to launch from: on an H200 with 16 cores, 8 workers
# finished 9 trials of studies/full.toml in 90 s and 22 under MPS, one worker 7 (docs/gpu.md, 2026-11-28). 8 is
# the most measured.
MAX_DEFAULT_PER_GPU = 8
# A worker's GPU memory at challenge size, rounded up: its CUDA context (about 0.5 GiB) and a trial's allocations
# with the training file on the card (0.78 GiB peak for full.toml's base MLP, docs/gpu.md's part (d) on an H200).
WORKER_GPU_BYTES = 2 * 2**30
NVIDIA_SMI_TIMEOUT_S = 10  # nvidia-smi answers in well under a second; a hung driver must not hang the plan
# Where NVIDIA's MPS control daemon listens (its default; CUDA_MPS_PIPE_DIRECTORY moves it): workers on one GPU
# under MPS run their kernels side by side instead of time-sharing the card.
MPS_PIPE_ENV, MPS_PIPE_DEFAULT = "CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"


@dataclass(frozen=True)
class WorkerPlan:
    """How many local workers, and the CUDA_VISIBLE_DEVICES entries of the GPUs they share (none: left alone)."""
    workers: int
    gpus: tuple[str, ...] = ()
    per_gpu: int = 1
    machine: bool = False  # chosen by machine_defaults (no device option given, GPUs seen): said in one line
    seen: int = field(default=0, compare=False)  # the CUDA devices this process sees
    auto: bool = field(default=False, compare=False)  # --workers auto: the number was the machine's


def workers_arg(text: str) -> int | str:
    """argparse type of `--workers` and `--population`: a whole number, or auto (anything else is argparse's
    one-line error)."""
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number or auto, got '{text}'") from None


def count_arg(text: str) -> int:
    """argparse type of `--per-gpu`: a whole number (its bounds are checked with the plan, as
    $LATENTSWEEP_PER_GPU's are)."""
    if not re.fullmatch(r"\s*-?[0-9]+\s*", text):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got '{text}'")
    return int(text)


def check_population(name: str, value) -> int | str:
    """`--population`: auto, or a whole number from 1 to MAX_POPULATION, the largest auto measures (each member is
    a claimed trial with its heartbeat and run: a typo's billion would claim trials until the budget ends)."""
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LatentsweepError(f"{name} must be a whole number >= 1 or auto, got {value!r}")
    if value > MAX_POPULATION:
        raise LatentsweepError(f"{name} must be <= {MAX_POPULATION} (the largest population auto measures) or auto, "
                               f"got {value}")
    return value


def max_workers() -> int:
    """The most worker processes this machine's memory can start (WORKER_START_BYTES each), at least 1."""
    return max(1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // WORKER_START_BYTES)


def check_workers(name: str, value: int, auto: bool = True) -> int:
    """A count of local worker processes (`--workers`, `--per-gpu`, the API's workers): 1 .. max_workers()."""
    high = max_workers()
    why = f" (the worker processes this machine's memory can start, {WORKER_START_BYTES >> 20} MB each)"
    return check_count(name, value, 1, high, why + (" or auto" if auto else ""))


def default_per_gpu(count: int, cpus: int) -> int:
    """Worker slots per GPU when no device option is given: the machine's cores shared by its `count` GPUs, one slot
    per CPU_THREADS_PER_WORKER of them, 1 to MAX_DEFAULT_PER_GPU, no more than the machine's memory can start
    (max_workers) nor the smallest GPU's memory holds (WORKER_GPU_BYTES each)."""
    cards = gpu_memory_bytes()
    by_card = min(cards) // WORKER_GPU_BYTES if cards else MAX_DEFAULT_PER_GPU  # unread: no cap by the cards
    return max(1, min(MAX_DEFAULT_PER_GPU, cpus // CPU_THREADS_PER_WORKER // max(count, 1),
                       max_workers() // max(count, 1), by_card))


def gpu_memory_bytes() -> list[int]:
    """Each visible GPU's memory, from nvidia-smi (NVML; this process's CUDA stays uninitialised, so the workers can
    still be pinned); empty when it cannot be read (no nvidia-smi, another vendor's card)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True).stdout
        return [int(line) * 2**20 for line in out.split()]  # MiB
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def machine_defaults(count: int, workers: int | str | None, gpus: str | None, per_gpu: int | None,
                     cpus: int = 1) -> tuple[int | str, str | None, int | None]:
    """(workers, gpus, per_gpu) of `study run|run` from the CUDA devices seen, the cores and the options given (None:
    not given). With no device option on a machine with GPUs: every GPU, default_per_gpu workers on each; on a CPU
    machine one worker, as before. A device option given (--workers, --gpus, --per-gpu) is the user's plan, kept as
    it is. Each worker trains one trial at a time unless --population is given (its default, 1, is the option's:
    `auto` trained fewer trials of full.toml's space at challenge size than one trial at a time, its trials rarely
    sharing a shape; docs/gpu.md)."""
    if workers is None and gpus is None and per_gpu is None:
        return (AUTO, ALL, default_per_gpu(count, cpus)) if count > 0 else (1, None, None)
    return (1 if workers is None else workers), gpus, per_gpu


def mps_running() -> bool:
    """Whether an MPS control daemon listens where this process's CUDA clients would look for it (its pipe
    directory's `control` socket)."""
    return (Path(os.environ.get(MPS_PIPE_ENV) or MPS_PIPE_DEFAULT) / "control").exists()


def mps_note(plan: WorkerPlan) -> str:
    """What the plan line says of MPS when several workers share a GPU: on, or how to turn it on and why."""
    if not plan.gpus or plan.per_gpu < 2:
        return ""
    if mps_running():
        return "; MPS on: the workers' kernels run side by side"
    return ("; MPS off: the workers time-share each GPU (`nvidia-cuda-mps-control -d` first: 2.4x the trials a "
            "minute measured, docs/gpu.md)")


def describe_plan(plan: WorkerPlan, population: int | str, slot: str | None = None) -> str | None:
    """The one line of what `study run|run` (or a `worker` on its `slot`) uses: GPUs, workers, population; None on
    a machine without GPUs when the numbers were all given (nothing was chosen for the user)."""
    each = f"{population} per worker"
    if population == AUTO:
        each = "sized on each GPU from its memory and step time" if plan.seen else "1 on a CPU"
    tail = f"population {population} ({each})"
    if slot is not None:
        return f"using GPU {slot}: a free slot of {len(plan.gpus)} GPU(s) x --per-gpu {plan.per_gpu}, {tail}"
    if plan.machine:
        return (f"using every GPU: {len(plan.gpus)} ({','.join(plan.gpus)}), {plan.workers} worker(s) "
                f"({plan.per_gpu} per GPU: one per {CPU_THREADS_PER_WORKER} cores, at most {MAX_DEFAULT_PER_GPU}, "
                f"{WORKER_GPU_BYTES >> 30} GiB of the GPU each), "
                f"{tail}{mps_note(plan)}; --workers 1 trains one trial at a time")
    how = " (--workers auto)" if plan.auto else ""
    if plan.gpus:
        return (f"using GPU(s) {','.join(plan.gpus)}: {plan.workers} worker(s){how}, {plan.per_gpu} per GPU, each "
                f"pinned to its GPU, {tail}{mps_note(plan)}")
    if plan.seen:
        return (f"using {plan.workers} worker(s) not pinned (each sees all {plan.seen} GPU(s); --gpus pins each to "
                f"one), {tail}")
    if plan.auto:
        return f"using {plan.workers} worker(s) (--workers auto: one per {CPU_THREADS_PER_WORKER} cores), {tail}"
    return None


def parse_gpus(text: str, count: int) -> tuple[int, ...]:
    """The GPU ordinals of `--gpus` ('all' or a comma list such as '0,1'), each below `count`, the GPUs this process
    sees; one-line errors."""
    if count < 1:
        raise LatentsweepError(f"--gpus {text}: no CUDA device is available on this machine{visible_note()}")
    if text.strip() == ALL:
        return tuple(range(count))
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and p.isascii() for p in parts):
        raise LatentsweepError(f"--gpus must be 'all' or GPU numbers separated by commas (e.g. 0,1), got '{text}'")
    ordinals = tuple(int(p) for p in parts)
    if len(set(ordinals)) < len(ordinals):
        raise LatentsweepError(f"--gpus {text}: a GPU is named twice (use --per-gpu for several workers per GPU)")
    beyond = [o for o in ordinals if o >= count]
    if beyond:
        raise LatentsweepError(f"--gpus {text}: this machine has {count} CUDA device(s) (0 to {count - 1}), "
                               f"not {', '.join(map(str, beyond))}{visible_note()}")
    return ordinals


def machine_ids(ordinals: Sequence[int], visible: str | None) -> tuple[str, ...]:
    """What a child's CUDA_VISIBLE_DEVICES names for each ordinal: this process's own entry when it is pinned
    itself (ordinal 1 under CUDA_VISIBLE_DEVICES=2,3 is GPU 3), else the ordinal."""
    entries = [e.strip() for e in visible.split(",")] if visible else []
    return tuple(entries[o] if o < len(entries) else str(o) for o in ordinals)


def assign_slots(gpus: Sequence[str], per_gpu: int, workers: int) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES of each of `workers` local workers: `per_gpu` slots on each GPU, filled a round at a
    time (one worker on every GPU, then a second on every GPU...), so fewer workers than slots still spread over all
    the GPUs; None for every worker when there are no GPUs (nothing is set). Slot i is on GPU i mod len(gpus): the
    slots are never listed, as a --per-gpu typo would make them billions."""
    if not gpus:
        return [None] * workers
    if workers > len(gpus) * per_gpu:
        raise LatentsweepError(f"--workers {workers} is more than {len(gpus)} GPU(s) x --per-gpu {per_gpu} = "
                               f"{len(gpus) * per_gpu} slots (raise --per-gpu, or leave --workers auto)")
    return [gpus[i % len(gpus)] for i in range(workers)]


def auto_workers(gpus: Sequence[str], per_gpu: int, cpus: int) -> int:
    """`--workers auto`: every GPU slot, or on a machine without GPUs one worker per CPU_THREADS_PER_WORKER cores."""
    return len(gpus) * per_gpu if gpus else max(1, cpus // CPU_THREADS_PER_WORKER)


def plan_workers(workers: int | str | None, gpus: str | None, per_gpu: int | None) -> WorkerPlan:
    """The local workers of `study run|run` from `--workers`, `--gpus` and `--per-gpu` (None: not given), checked
    against this machine before anything is stored. None of them given on a machine with GPUs: all of them
    (machine_defaults); `--workers auto` alone too; otherwise without --gpus nothing is pinned.
    torch.cuda.device_count() asks NVML: it does not initialise CUDA in this process."""
    if per_gpu is not None:
        check_workers("--per-gpu", per_gpu, auto=False)
    if workers not in (AUTO, None) and workers < 1:
        raise LatentsweepError(f"--workers must be >= 1 or auto, got {workers}")
    count = torch.cuda.device_count()
    machine = count > 0 and workers is None and gpus is None and per_gpu is None
    workers, gpus, per_gpu = machine_defaults(count, workers, gpus, per_gpu, cpus=usable_cores())
    auto = workers == AUTO
    if gpus is None and auto and count > 0:
        gpus = ALL
    if gpus is None:
        if per_gpu is not None:
            raise LatentsweepError("--per-gpu needs --gpus (which GPUs to share among the workers)")
        n = auto_workers((), 1, usable_cores()) if auto else workers
        return WorkerPlan(check_workers("--workers", n), seen=count, auto=auto)
    ids = machine_ids(parse_gpus(gpus, count), os.environ.get(VISIBLE_ENV))
    per_gpu = per_gpu or 1
    n = check_workers("--workers", auto_workers(ids, per_gpu, usable_cores()) if auto else workers)
    assign_slots(ids, per_gpu, n)  # the check: no more workers than slots
    return WorkerPlan(n, ids, per_gpu, machine, seen=count, auto=auto)


def env_defaults(gpus: str | None, per_gpu: int | None) -> tuple[str | None, int | None, dict[str, str]]:
    """(gpus, per_gpu, {option: variable it came from}): --gpus and --per-gpu, when not given, from $LATENTSWEEP_GPUS
    and $LATENTSWEEP_PER_GPU."""
    named = {}
    if gpus is None and os.environ.get(GPUS_ENV):
        gpus, named["--gpus"] = os.environ[GPUS_ENV], f"${GPUS_ENV}"
    if per_gpu is None and os.environ.get(PER_GPU_ENV):
        text = os.environ[PER_GPU_ENV]
        if not re.fullmatch(r"\s*-?\d+\s*", text):
            raise LatentsweepError(f"${PER_GPU_ENV} must be a whole number, got '{text}'")
        per_gpu, named["--per-gpu"] = int(text), f"${PER_GPU_ENV}"
    return gpus, per_gpu, named


def plan_workers_env(workers: int | str, gpus: str | None, per_gpu: int | None) -> WorkerPlan:
    """plan_workers with --gpus and --per-gpu, when not given, from $LATENTSWEEP_GPUS and $LATENTSWEEP_PER_GPU (how
    compose's worker replicas get them); an error a variable caused names the variable, not an option the user did
    not type."""
    gpus, per_gpu, named = env_defaults(gpus, per_gpu)
    try:
        return plan_workers(workers, gpus, per_gpu)
    except LatentsweepError as exc:
        line = str(exc)
        for option, variable in named.items():
            line = line.replace(option, variable)
        raise LatentsweepError(line) from None


def pin_process(visible: str | None) -> None:
    """Make this process see only `visible` (CUDA_VISIBLE_DEVICES), before its first CUDA call; None leaves it
    alone. The driver reads the variable once, when CUDA initialises: a process that initialised it already would
    go on seeing every GPU, which is said in one line instead of training on the wrong GPU."""
    if visible is None:
        return
    os.environ[VISIBLE_ENV] = visible
    seen = torch.cuda.device_count()
    if seen and seen != len(visible.split(",")):
        raise LatentsweepError(f"cannot pin this process to GPU(s) {visible}: CUDA was initialised before "
                               f"(it sees {seen} GPUs); set {VISIBLE_ENV}={visible} in its environment instead")



def claim_slot(gpus: Sequence[str], per_gpu: int, lock_dir: Path) -> str | None:
    """`latentsweep worker --gpus LIST [--per-gpu M]`: the GPU of the first free slot, in assign_slots' order, for
    this worker process. A slot is claimed by an exclusive lock on its file under `lock_dir` (in the state directory,
    which compose's worker replicas share), held until the process exits however it exits, so a dead worker's slot
    is free at once. None without GPUs; one line when every slot is taken."""
    if not gpus:
        return None
    for i in range(len(gpus) * per_gpu):  # assign_slots' order, one slot at a time
        gpu = gpus[i % len(gpus)]
        fd = _open_lock(lock_dir, f"gpu-{SLOT_FILE_CHARS.sub('_', gpu)}-{i // len(gpus)}.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        HELD.append(fd)
        return gpu
    raise LatentsweepError(f"every GPU slot ({len(gpus)} GPU(s) x --per-gpu {per_gpu}) is held by another worker "
                           f"(locks in {lock_dir})")


def _open_lock(lock_dir: Path, name: str) -> int:
    """The open lock file `name` in `lock_dir`, made if needed; one line naming the folder when it cannot be."""
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        return os.open(lock_dir / name, os.O_CREAT | os.O_RDWR)
    except OSError as exc:
        raise LatentsweepError(f"cannot lock a GPU slot in {lock_dir} ({exc.strerror}): the workers of this machine "
                               "claim their GPUs there; make it a writable folder, or give another --state-dir"
                               ) from None
