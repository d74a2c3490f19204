"""The one classification of what can stop a trial (config, memory, machine, store outage, interrupt, our bug)."""
from __future__ import annotations

import contextlib
import gc
import re
import sys
import traceback
from dataclasses import dataclass
from enum import Enum
from typing import Iterator

from latentsweep.search.redact import redact_url
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.core.progress import say


class StudyHalted(Exception):
    """Another worker of this study stopped on a bug: this one stops before claiming a trial (not a user error)."""


# Compared with Optuna's `study.optimize(catch=...)`: CONFIG and MEMORY are what a `catch` tuple would hold (the trial
# is FAIL, it counts, the study goes on); BUG is an exception outside `catch` (FAIL, re-raised: the study stops, and
# here every other worker stops before its next trial too); INTERRUPT is Optuna's KeyboardInterrupt (FAIL,
# re-raised). Optuna has no counterpart for MACHINE and OUTAGE: it would count them as failed trials, burning the
# budget while a disk is full or a server is down. Here they are retried instead (a WAITING copy of the trial, at
# most StorageSettings.max_retry times, as for a worker that died), and the worker stops with one line.


class Kind(Enum):
    CONFIG = "config"  # the configuration cannot train (a bad value found at run time, divergence)
    MEMORY = "memory"  # the configuration does not fit this machine's memory (GPU OOM, CPU allocation failure)
    MACHINE = "machine"  # the file system refused (any OSError), the GPU failed, or other processes filled a shared GPU
    OUTAGE = "outage"  # the tracking store or the Optuna storage is unreachable, locked or failing
    INTERRUPT = "interrupt"  # Ctrl-C, SIGTERM
    BUG = "bug"  # anything else: a bug in our code (or a library's), never the configuration's fault


COUNTED = (Kind.CONFIG, Kind.MEMORY, Kind.BUG)  # the trial is FAIL for good and counts in the budget
RETRIED = (Kind.MACHINE, Kind.OUTAGE, Kind.INTERRUPT)  # the trial is FAIL, not counted, and a WAITING copy is queued
GOES_ON = (Kind.CONFIG, Kind.MEMORY)  # the worker claims its next trial; otherwise it stops


class StoreFailed(LatentsweepError):
    """The tracking store or the storage failed: the worker stops in one line, the trial is retried."""


class MachineFailed(LatentsweepError):
    """The file system refused a write (disk full, read-only): the worker stops in one line, the trial is retried."""


# What an unreachable store raises at the bottom of the chain: SQLAlchemy's connection/lock errors (MLflow's SQL
# store re-raises them as MlflowException(TEMPORARILY_UNAVAILABLE) `from` them), requests' (MLflow's REST client
# raises its MlflowException inside the `except`, so they are its __context__), and the built-in ones.
# The libraries' classes are looked up by name in the libraries already imported (see `loaded`).
OUTAGE_ERRORS = (("sqlalchemy.exc", ("OperationalError", "InterfaceError", "DisconnectionError", "TimeoutError")),
                 ("requests.exceptions", ("ConnectionError", "Timeout")),
                 ("builtins", ("ConnectionError", "TimeoutError")))
# MLflow error codes (its protos' ErrorCode names, mlflow.exceptions) of a server that is down or overloaded: a 5xx
# or a 429 answer of a tracking server, a locked or lost SQL store. An MlflowException is read by its code only, so
# that only the MLflow tracker imports MLflow.
OUTAGE_CODES = {"TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "DEADLINE_EXCEEDED", "ABORTED"}
# torch's CPU allocator raises a plain RuntimeError (c10/core/impl/alloc_cpu.cpp): an oversized config, not a bug.
CPU_ALLOC_FAILED = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")
MEMORY_ERRORS = (("torch", ("OutOfMemoryError",)), ("builtins", ("MemoryError",)))
# A CUDA error that is not an allocation failure (a lost or busy device, an ECC or launch failure; torch raises
# torch.AcceleratorError, which torch 2.13 has and older releases may not) says the GPU failed, not the config: the
# trial is retried, elsewhere or later, like a full disk. A device-side assert is one too: it is retried at most
# StorageSettings.max_retry times, then the worker has stopped with its line each time.
ACCELERATOR_ERRORS = (("torch", ("AcceleratorError",)),)
# The caching allocator's message (c10/cuda/CUDACachingAllocator.cpp): "Tried to allocate 2.00 GiB. GPU 0 has a total
# capacity of 79.19 GiB of which 1.10 GiB is free. Process 4242 has 70.00 GiB memory in use. Including non-PyTorch
# memory, this process has 8.00 GiB memory in use." The driver names the other processes on the GPU (NVML).
OOM_ASKED = re.compile(r"Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB)")
OOM_FREE = re.compile(r"of which ([0-9.]+) (bytes|KiB|MiB|GiB) is free")
OOM_OTHERS = re.compile(r"Process [0-9]+ has ([0-9.]+) (bytes|KiB|MiB|GiB) memory in use")
UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


@dataclass(frozen=True)
class Failure:
    """An exception, classified: `reason` is its one line (passwords hidden), `detail` the traceback of a bug."""
    kind: Kind
    reason: str
    detail: str
    exc: BaseException

    @property
    def counts(self) -> bool:
        return self.kind in COUNTED

    @property
    def retried(self) -> bool:
        return self.kind in RETRIED

    @property
    def goes_on(self) -> bool:
        return self.kind in GOES_ON

    def user_error(self, trial_number: int | None = None) -> BaseException:
        """What stops the worker (or command): the bug or the interrupt itself, else a one-line user error, which
        names the trial and says it is retried when there is one."""
        if self.kind in (Kind.BUG, Kind.INTERRUPT):
            return self.exc
        where = f"trial {trial_number}: " if trial_number is not None else ""
        then = "; the trial is retried when the study runs again" if trial_number is not None else ""
        if self.kind is Kind.OUTAGE:
            what = self.exc if isinstance(self.exc, StoreFailed) else f"a store failed ({self.reason})"
            return StoreFailed(f"{where}{what}{then}")
        if self.kind is Kind.MACHINE:
            return MachineFailed(f"{where}{self.reason}{then}")
        return LatentsweepError(f"{where}{self.reason}")


def chain(exc: BaseException):
    """exc, then its causes and contexts (each once)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def loaded(spec: tuple[tuple[str, tuple[str, ...]], ...]) -> tuple[type, ...]:
    """The exception classes (module, names) of `spec` whose module is already imported: an exception of a
    library's class can only exist once that library is loaded, so classifying imports nothing, and `import
    latentsweep.search.failures` costs no torch, requests or SQLAlchemy (the CLI's start-up, docs/design.md "Start-up").
    A name
    a module lacks (torch.AcceleratorError before torch 2.x) is skipped."""
    found = []
    for module, names in spec:
        mod = sys.modules.get(module)
        if mod is not None:
            found += [getattr(mod, name) for name in names if isinstance(getattr(mod, name, None), type)]
    return tuple(found)


def outage_in(exc: BaseException) -> BaseException | None:
    """The error in exc's chain that says a store is unreachable (its message is the informative one: Optuna's
    StorageInternalError hides "database or disk is full" in its cause), or None."""
    outage_errors = loaded(OUTAGE_ERRORS)
    for err in chain(exc):
        if isinstance(err, outage_errors) or getattr(err, "error_code", None) in OUTAGE_CODES:
            return err
    return None


def kind_of(exc: BaseException) -> Kind:
    """The class of `exc` (see Kind); the one place that decides it."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return Kind.INTERRUPT
    if isinstance(exc, StoreFailed):
        return Kind.OUTAGE
    if isinstance(exc, MachineFailed):
        return Kind.MACHINE
    if isinstance(exc, LatentsweepError):
        return Kind.CONFIG
    if isinstance(exc, loaded(MEMORY_ERRORS[:1])) and shared_gpu_short(str(exc)):  # torch's, not Python's
        return Kind.MACHINE
    if isinstance(exc, loaded(MEMORY_ERRORS)) or (isinstance(exc, RuntimeError) and any(s in str(exc)
                                                                                for s in CPU_ALLOC_FAILED)):
        return Kind.MEMORY
    if isinstance(exc, loaded(ACCELERATOR_ERRORS)):
        return Kind.MACHINE
    if outage_in(exc) is not None:
        return Kind.OUTAGE
    if isinstance(exc, OSError):  # the file system's answer (full, read-only, missing, a directory): not our code's
        return Kind.MACHINE
    return Kind.BUG


def shared_gpu_short(message: str) -> bool:
    """Whether a CUDA out-of-memory error is the shared GPU's fault rather than the config's: the driver names other
    processes on the GPU, and the memory they hold is at least what was missing (asked minus free), so the same
    allocation would have fit on the GPU alone. Then the trial is retried (MACHINE), not counted as a config that
    does not fit (MEMORY). Anything else stays MEMORY, as does every CPU allocation failure: a message without the
    other processes (NVML cannot see them from some containers) cannot tell the two apart."""
    asked, free = OOM_ASKED.search(message), OOM_FREE.search(message)
    others = [_bytes(m) for m in OOM_OTHERS.finditer(message)]
    if asked is None or free is None or not others:
        return False
    return sum(others) >= _bytes(asked) - _bytes(free)


def _bytes(match: re.Match) -> float:
    return float(match.group(1)) * UNITS[match.group(2)]


def first_line(exc: BaseException, limit: int = 300) -> str:
    """'Type: first line of the message', passwords hidden."""
    if isinstance(exc, OSError) and exc.strerror:  # its own words name the file and the reason
        return redact_url((f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror)[:limit])
    text = redact_url((str(exc).strip().splitlines() or [""])[0][:limit])
    return text if isinstance(exc, LatentsweepError) else f"{type(exc).__name__}: {text}".rstrip(": ")


def classify(exc: BaseException) -> Failure:
    kind = kind_of(exc)
    detail = "".join(traceback.format_exception(exc)) if kind == Kind.BUG else first_line(exc, 4000)
    said = outage_in(exc) if kind == Kind.OUTAGE and not isinstance(exc, StoreFailed) else exc
    reason = detail.strip().splitlines()[-1][:500] if kind == Kind.BUG else first_line(said)
    return Failure(kind, redact_url(reason), redact_url(detail), exc)


@dataclass
class Attempt:
    """What a best_effort block ended with: its failure, or None when it finished."""
    failure: Failure | None = None


@contextlib.contextmanager
def best_effort(what: str) -> Iterator[Attempt]:
    """Run the block as something whose failure must not stop the caller (the results it concerns are in place
    already): our own bug is raised with its traceback; any other exception is said in one line, `could not WHAT
    (reason)`, and the code after the block runs (`attempt.failure` tells it). An interrupt (not an Exception) goes
    through untouched."""
    attempt = Attempt()
    try:
        yield attempt
    except Exception as exc:  # noqa: BLE001 - classified once: a bug is raised, the rest said
        attempt.failure = classify(exc)
        if attempt.failure.kind is Kind.BUG:
            raise
        say(f"could not {what} ({attempt.failure.reason})")


def release_interrupted(exc: BaseException) -> None:
    """Free what an interrupt left half-done before anything else writes to a store. A KeyboardInterrupt raised inside
    an MLflow or Optuna call can leave that call's SQLAlchemy session, and with it SQLite's write lock, referenced only
    by the finished frames of its traceback: every later write, from any process, then waits for the lock and fails
    with "database is locked". Clearing those frames and collecting closes the session (measured with a SIGINT at a
    random moment of a log_batch loop: the lock stayed held after 12 of 100 interrupts without this, 0 of 300 with).
    Frames still running (the caller's) are left alone; a bug's traceback is never touched."""
    if kind_of(exc) is Kind.INTERRUPT:
        traceback.clear_frames(exc.__traceback__)
        gc.collect()


def one_line(exc: BaseException) -> str | None:
    """What a command prints for `exc` before exiting 2 (a user error, a full disk, a store down, a config that does
    not fit in memory), or None for a bug or an interrupt, which are raised on."""
    failure = classify(exc)
    if failure.kind in (Kind.BUG, Kind.INTERRUPT):
        return None
    return str(exc) if isinstance(exc, LatentsweepError) else failure.reason  # ours may list problems, one a line


def raise_stop(exc: BaseException, where: str) -> None:
    """Raise what stops a run outside a study (a pick job): the bug or interrupt itself, else its one-line error."""
    failure = classify(exc)
    stop = failure.user_error()
    if stop is exc:
        raise exc
    raise type(stop)(f"{where}: {stop}") from exc
