"""A worker's population: up to K claimed trials trained side by side (latentsweep.trainers.train.population), each told
on its own."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

import latentsweep.trainers.train.population as stacking
from latentsweep.search.failures import release_interrupted
from latentsweep.search.process import raise_if_interrupted
from latentsweep.search.study import worker
from latentsweep.search.study.devices import AUTO
from latentsweep.search.study.objective import Started, TrialRunner
from latentsweep.search.study.samplers import fixing
from latentsweep.search.study.space import Param
from latentsweep.search.study.storage import storage_of, trial_id
from latentsweep.search.study.studyfile import StudyFile
from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.data.sets import TrainSet
from latentsweep.trainers.core.devices import resolve_device
from latentsweep.trainers.train.population import Member, stack_key
from latentsweep.trainers.core.progress import say


def population_size(population: int | str, study_file: StudyFile, spec, data: TrainSet) -> int:
    """The places of this worker's population: `--population N`, or auto:
    latentsweep.trainers.train.population.population_size for
    the study's base config on the worker's device (1 on a CPU, CPU_POPULATION, measured there; on a GPU from the
    measured memory and step time of stacked members). A study's trials of other shapes train in their own groups."""
    if population != AUTO:
        return int(population)
    cfg = with_values(study_file.base, {"data.path": spec.data_path, "train.threads": spec.threads})
    return max(1, int(stacking.population_size(cfg, data, resolve_device(cfg.train.device))))


@dataclass
class Seat:
    """One claimed trial of the population: its heartbeat from its claim to its end, its open run once started."""
    trial: optuna.Trial
    beat: worker.Heartbeat
    started: Started | None = None
    key: tuple | None = None
    group: int = 0  # the train_population call it trains in (its population's id, with the worker's)
    ended: bool = False
    shape: dict[str, Any] | None = None  # as a group's first: {parameter: its value} a joiner shares (shape_params)


@dataclass
class Population:
    """Claims up to `size` trials, trains those of one stack_key together (train_population), tells each trial as
    soon as it ends and fills its place with a newly claimed trial (`join`), within the budget and the search's end,
    exactly as worker_loop claims (claim_trial counts running trials, next_trial_fits checks the time)."""
    study_file: StudyFile
    spec: object
    study: optuna.Study
    runner: TrialRunner
    size: int
    on_trial: Callable[[optuna.trial.FrozenTrial], None] | None = None
    ran: int = 0
    seats: list[Seat] = field(default_factory=list)  # claimed and not ended: training or waiting for their group
    stop: BaseException | None = None  # the first failure that stops this worker, raised once its group is done
    groups: int = 0
    current: Seat | None = None  # a seat of the group in training (its key and group id), None between groups
    founders: list[Seat] = field(default_factory=list)  # the seats the group in training started with

    def run(self) -> int:
        """Claim, train and tell until the budget is reached or the next trial would not fit; how many it ran."""
        poll = min(worker.WAIT_POLL_S, storage_of(self.study).get_heartbeat_interval() or worker.WAIT_POLL_S)
        try:
            while True:
                raise_if_interrupted()
                if self.stop is not None:
                    raise self.stop
                worker.check_halted(self.study)
                waiting = list(self.seats)  # between groups every seat held waits for its group
                if not waiting:
                    seat = self._claim()
                    if seat is None:
                        if not self.runner.next_trial_fits(self.study) or worker.counted(self.study) >= \
                                self.spec.n_trials:
                            break
                        time.sleep(poll)  # the budget is full of others' running trials: one may die
                        continue
                    self._fill()
                    continue
                if len({s.group for s in waiting}) == 1:  # a trial of another shape the last group left waiting:
                    self._fill()  # its places, claimed with its shape (a group keeps the places it starts with)
                self._train([s for s in self.seats if s.group == self.seats[0].group])
        except BaseException as exc:
            self._end_all(exc)
            raise
        return self.ran

    def _fill(self) -> None:
        """Claim up to `size` trials for the first group, each asked with its first trial's shape (`_claim`),
        stopping at the first trial of another shape (an enqueued or retried trial keeps its own values): it waits as
        the next group's first. Claiming on past it would hold trials RUNNING, untrained, while the groups train one
        after another (on a GPU at challenge size, a population of 16 in full.toml's space, where batch size, model
        kind, width and slots give each trial its own group, left 12 of its 16 trials without an epoch in 48 s)."""
        while len(self.seats) < self.size:
            seat = self._claim()
            if seat is None or seat.group != self.seats[0].group:
                return

    def _claim(self, joining: bool = False) -> Seat | None:
        """Claim a trial when one fits (budget, search's end), start it and place it in a group; None when none. It
        is asked with the shape of the group whose place it fills (`_shape`), so that it stacks there: the first
        waiting group's, or when it joins, the group in training's while one of the trials that group started with
        still trains. Once the pruner has ended all of those, a joiner is asked freely, as the group's first was,
        and one of another shape lets the group drain: a group that always took joiners of its shape would give
        one worker's every later trial its first shape (on full.toml's space at --population 4, trials 3 to 10 of
        a two-minute study all took enqueued trial 3's)."""
        if joining:
            leader = self.current if any(not s.ended for s in self.founders) else None
        else:
            leader = self.seats[0] if self.seats else None
        with fixing(self.study, self._shape(leader)):
            return self._claim_started(joining)

    def _shape(self, leader: Seat | None) -> dict[str, Any]:
        """{parameter: value} of `leader`'s trial that a trial asked for its group shares (shape_params), once per
        group; the first time, said in one line."""
        if leader is None or leader.started is None or leader.key is None:
            return {}
        if leader.shape is None:
            leader.shape = shape_params(leader.started.cfg, leader.trial.params, self.study_file.space)
        if leader.shape:
            say(f"population: a trial that fills a place of a group is asked with the group's shape fixed to its first "
                f"trial's values (here {', '.join(leader.shape)} of trial {leader.trial.number}), so it trains stacked "
                f"there, while a trial the group started with trains; the other knobs are sampled, an enqueued trial "
                f"keeps its own values", once=("population-shape", self.study.study_name))
        return leader.shape

    def _claim_started(self, joining: bool) -> Seat | None:
        """_claim's claim: a trial that fails to start (a config that cannot sample) is told at once and its place
        claimed again."""
        while self.stop is None and self.runner.next_trial_fits(self.study):
            try:
                trial = worker.claim_trial(self.study, self.spec.n_trials)
                if trial is None:
                    worker.close_dead_runs(self.study, self.runner.tracker)  # the claim may have failed dead trials
                    return None
            except BaseException as exc:  # noqa: BLE001 - no trial to fail: one line, or the bug/interrupt itself
                worker.fail_or_stop(self.study, self.runner, None, exc)
            seat = Seat(trial, worker.Heartbeat(storage_of(self.study), trial_id(trial)))
            self.seats.append(seat)
            try:
                seat.beat.__enter__()
                worker.close_dead_runs(self.study, self.runner.tracker)
                cfg, out, values, side = self.runner.configure(trial)
                seat.key = stack_key(cfg)
                seat.group = self._group_of(seat.key, joining)
                seat.started = self.runner.open(trial, cfg, out, values, side, population={
                    "id": f"{worker.worker_id()}/{seat.group}", "size": self.size})
            except BaseException as exc:  # noqa: BLE001 - this trial's failure: told now; a stop is raised
                self._told(seat, exc)
                if self.stop is not None:
                    raise self.stop
                continue
            return seat
        return None

    def _group_of(self, key: tuple | None, joining: bool) -> int:
        """The group a newly claimed trial trains in: the group in training when it joins one of its key, else the
        waiting group of its key, else a new group (a None key trains alone)."""
        if joining and key is not None and self.current is not None and key == self.current.key:
            return self.current.group
        same = [s.group for s in self.seats if s.group and s.key == key and key is not None and not s.ended
                and (self.current is None or s.group != self.current.group)]
        if same:
            return same[0]
        self.groups += 1
        return self.groups

    def _member(self, seat: Seat) -> Member:
        return Member(seat.started.cfg, callback=seat.started.callback, out_dir=seat.started.out,
                      deadline=self.runner.deadline, done=lambda end: self._told(seat, end))

    def _train(self, group: list[Seat]) -> None:
        """Train one group, its free places filled by `join` while no other group waits."""
        self.current, self.founders = group[0], list(group)

        def join() -> Member | None:
            if self.stop is not None or any(s.group != self.current.group for s in self.seats):
                return None  # the worker stops, or another group waits: let this one drain
            try:
                raise_if_interrupted()
                worker.check_halted(self.study)  # as worker_loop, before each claim
                seat = self._claim(joining=True)
            except (KeyboardInterrupt, SystemExit):
                raise  # stops the whole population (latentsweep.trainers.train.population); run() fails what it holds
            except BaseException as exc:  # noqa: BLE001 - the group's members go on; raised once they end
                self.stop = self.stop or exc
                return None
            return self._member(seat) if seat is not None and seat.group == self.current.group else None

        gid = group[0].group
        try:
            stacking.train_population([self._member(s) for s in group], self.runner.data, join=join,
                                      progress=self.spec.progress)
        except Exception as exc:  # noqa: BLE001 - the shared step failed: each member it held ends with it, as a
            for seat in [s for s in self.seats if s.group == gid]:  # trial alone would (a bug counts and halts)
                self._told(seat, exc)
        finally:
            self.current, self.founders = None, []
        lost = [s for s in self.seats if s.group == gid]
        if lost:  # a member train_population never ended: our bug or its, said loudly, its trial failed
            raise RuntimeError(f"train_population ended without ending trial(s) "
                               f"{', '.join(str(s.trial.number) for s in lost)}")

    def _told(self, seat: Seat, end) -> None:
        """A member's end: finish it (COMPLETE/PRUNED) or fail it (latentsweep.search.failures decides), tell Optuna at
        once and
        free its place. A failure that stops the worker is kept in `stop` (the others of its group go on)."""
        seat.ended = True
        self.seats.remove(seat)
        try:
            try:
                if seat.started is None:
                    raise end
                state, value = self.runner.finish(seat.trial, seat.started, end)
            finally:
                _stop_beat(seat)
            frozen = self.study.tell(seat.trial, value, state=state)
        except BaseException as exc:  # noqa: BLE001 - classified by fail_or_stop: goes on, or stops the worker
            try:
                frozen = worker.fail_or_stop(self.study, self.runner, seat.trial, exc)
            except BaseException as stop:  # noqa: BLE001 - raised by run() once the group is done
                self.stop = self.stop or stop
                return
        self.ran += 1
        if self.on_trial is not None:
            self.on_trial(frozen)

    def _end_all(self, exc: BaseException) -> None:
        """The worker stops: every trial it still holds is failed (and retried: an interrupt, or the worker's
        stop), its run closed, before the error goes up."""
        release_interrupted(exc)
        for seat in list(self.seats):
            seat.ended = True
            self.seats.remove(seat)
            _stop_beat(seat)
            try:
                self.runner.fail(self.study, seat.trial, exc if isinstance(exc, (KeyboardInterrupt, SystemExit))
                                 else KeyboardInterrupt())
            except Exception as inner:  # noqa: BLE001 - the reaper fails it after the grace; said in one line
                say(f"could not fail trial {seat.trial.number} of a stopping population ({inner})")
        try:  # a run opened by a start the stop cut short (its id not returned yet) is closed with its failed trial
            worker.close_dead_runs(self.study, self.runner.tracker)
        except Exception as inner:  # noqa: BLE001 - `study reap` or the next start closes it; said in one line
            say(f"could not close the runs of a stopping population ({inner})")


# Where a continuous float knob is probed, as fractions of its range (of its log range when log): inside it only,
# since a sampled value never lands on a bound (a loss weight of exactly 0 turns the all-images bank off, which a
# float sampled in [0, 1] never does). A discrete knob (int, stepped float) is probed at every value up to MAX_GRID,
# else at its bounds and these fractions.
INTERIOR = (0.25, 0.5, 0.75)
MAX_GRID = 16


def shape_params(cfg: Config, params: dict[str, Any], space) -> dict[str, Any]:
    """{parameter: value} of `params` (a trial's, `cfg` its config) that a trial must share to stack with it: those
    of the space for which another value it can propose gives `cfg` another stack_key, one knob at a time. Derived
    from stack_key itself, no list of knobs beside it. In full.toml's space: model kind, width, slots and batch size,
    and a loss weight where it turns a batch entry on or off at the trial's values (the all-images bank at 0)."""
    key = stack_key(cfg)
    if key is None:
        return {}
    return {p.name: params[p.name] for p in space if p.name in params and _splits(cfg, key, p)}


def _splits(cfg: Config, key: tuple, param: Param) -> bool:
    for value in _probes(param):
        try:
            other = stack_key(with_values(cfg, {param.key: value}))
        except (LatentsweepError, ValueError, TypeError):  # no config of the group holds it: not a member's value
            return True
        if other != key:
            return True
    return False


def _probes(param: Param) -> list:
    """The values of `param` its keys are compared at (INTERIOR, MAX_GRID)."""
    if param.type == "categorical":
        return list(param.choices)
    low, high = param.low, param.high
    step = param.step or (1 if param.type == "int" else None)
    if step is not None and (high - low) / step < MAX_GRID:
        return [low + i * step for i in range(int(math.floor((high - low) / step + 1e-9)) + 1)]
    if param.log:
        inside = [math.exp(math.log(low) + q * (math.log(high) - math.log(low))) for q in INTERIOR]
    else:
        inside = [low + q * (high - low) for q in INTERIOR]
    if step is None:
        return inside
    return [low, high] + [low + round((v - low) / step) * step for v in inside]


def _stop_beat(seat: Seat) -> None:
    if seat.beat.thread.ident is not None:  # started (a thread that never started cannot be joined)
        seat.beat.__exit__()


def population_loop(study_file: StudyFile, spec, study: optuna.Study, runner: TrialRunner, size: int,
                    on_trial: Callable[[optuna.trial.FrozenTrial], None] | None = None) -> int:
    """worker_loop for a population of `size` > 1 places; returns how many trials this worker ran."""
    return Population(study_file, spec, study, runner, size, on_trial).run()


__all__ = ["Population", "population_loop", "population_size", "shape_params", "TrialState"]
