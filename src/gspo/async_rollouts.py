"""Asynchronous rollouts (`rollout.max_staleness` = k >= 1): the engine samples the next steps'
rollouts in a background thread while the trainer updates, as verl's one-step-off-policy trainer
and TRL's AsyncGRPOTrainer do.

Weight versions: version v is the policy after v updates (the trainer works on step v with
version v). Step m's rollouts are sampled from version max(s, m - k), s the step the run
started or resumed at: exactly that version, never a newer one, so a run is the same whatever
the two threads' timing (`rollout/staleness` = m - that version). The trainer publishes each
version after its update as a snapshot (a detached copy of every weight, taken in the trainer's
thread, where a sharded model's gather is a collective of all ranks); the sampler loads a
snapshot into the engine's own copy of the weights before the batch that needs it, and drops
the snapshots no batch will need.

What the sampler thread does: the rollout and the rewards (the producer), and the jobs the
trainer hands it (`recompute`: pi_old's forward on the engine's copy loaded with the trainer's
current weights, rollout.sampler_recomputes; one each step, before the batch sampled from the
same weights); what stays in the trainer's thread: every collective, the updates, evaluation
(`borrow` pauses the sampler and gives the engine the current weights), checkpoints.
In-flight rollouts are not saved: a resumed run samples its first step from the weights it
resumed with (staleness 0), so a resume loses no update but is not bit-identical to an
uninterrupted asynchronous run.

On the CPU the two threads share the cores (`CoreShare`): each computes with its share of
torch's threads while both work, and with all of them while the other waits.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from gspo.engines import Rollouts
from gspo.group_filter import FilterStats

WAIT_POLL_S = 0.5  # how often a waiting thread re-checks that the other is alive
TRAINER, SAMPLER = "trainer", "sampler"


class CoreShare:
    """The CPU's cores between the trainer's thread and the sampler's.

    While both compute, each uses its share of torch's threads (OpenMP's thread count is per
    thread); while one waits for the other (the sampler for the weight version its next batch
    needs, the trainer for a batch), the other takes all of them at its next checkpoint. The
    trainer's checkpoints are its model's decoder layers, forward and backward (`watch`); the
    sampler's, its batches and an engine's decode steps (`on_step`, where the engine has one).
    A fixed split idles a core through the shorter phase: on 2 cores the SmolLM2 recipe's
    update runs 1.55x faster on both than on one, and the sampler finishes first.

    The thread counts then follow the threads' timing, and so may a kernel's last bits (here a
    tiny model's update differs in the 7th digit between 1 and 2 threads): `lend=False`
    (rollout.share_cores=false) keeps the shares fixed, and a run independent of the timing.
    """

    def __init__(self, total: int, shares: dict[str, int], lend: bool = True):
        self.total, self.shares, self.lend = total, shares, lend
        self._waiting: set[str] = set()  # the roles waiting now (set / discard hold the GIL)
        self._local = threading.local()  # this thread's role and thread count
        self._hooks: list = []

    def join(self, role: str) -> None:
        """The calling thread computes as `role` from now on."""
        self._local.role, self._local.threads = role, None
        self.adjust()

    def adjust(self) -> None:
        """The calling thread's checkpoint: all the threads while the other role waits, else
        its share."""
        role = getattr(self._local, "role", TRAINER)
        other = SAMPLER if role == TRAINER else TRAINER
        n = self.total if self.lend and other in self._waiting else self.shares[role]
        if getattr(self._local, "threads", None) != n:
            torch.set_num_threads(n)
            self._local.threads = n

    def wake(self, role: str) -> None:
        """The calling thread is about to give `role` the work it waits for (the trainer
        publishing the weights the sampler needs): it takes its own share back now, not at its
        next checkpoint, past an optimiser step, a snapshot and the metrics with all the threads
        while the other works again (oversubscribed: the tiny model's async step lost 10%)."""
        self._waiting.discard(role)
        self.adjust()

    def leave(self) -> None:
        """The calling thread computes nothing more: the other role takes all the threads."""
        self._waiting.add(getattr(self._local, "role", TRAINER))

    @contextlib.contextmanager
    def waiting(self):
        """The calling thread waits (computes nothing) for the duration."""
        role = getattr(self._local, "role", TRAINER)
        self._waiting.add(role)
        try:
            yield
        finally:
            self._waiting.discard(role)
            self.adjust()

    def watch(self, model: torch.nn.Module) -> None:
        """Checkpoints before each decoder layer's forward and after its backward."""
        if not self.lend:
            return

        def before(module, args, kwargs):
            self.adjust()
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda grad: self.adjust())  # returns None: grad unchanged
        self._hooks += [layer.register_forward_pre_hook(before, with_kwargs=True)
                        for layer in _layers(model)]

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: the outermost ModuleList of more than one module (the model itself
    where there is none)."""
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > 1:
            return list(m)
    return [model]


@dataclass
class Batch:
    """One step's share of rollouts, decoded and scored (what the producer hands over)."""
    rows: list[dict]
    rollouts: Rollouts
    texts: list[str]
    rewards: list[float]
    reward_failures: int
    first_error: str | None
    version: int            # the weight version the rollouts were sampled from
    rollout_s: float        # sampling (and decoding) time, in the sampler's thread
    reward_s: float
    filter: FilterStats | None = None  # rollout.filter_groups: what it dropped and sampled


class Rows:
    """Per-row results the sampler's thread fills in while the trainer reads them (pi_old's
    log-probs and entropies, rollout.sampler_recomputes): `get` waits for the rows it asks
    for, and raises the sampler's failure, or its end, instead of waiting for ever."""

    def __init__(self, sampler: "AsyncSampler", B: int, T: int,
                 device: torch.device | str = "cpu"):
        self.sampler = sampler
        self.logp = torch.zeros(B, T, device=device)
        self.entropy = torch.zeros(B, T, device=device)
        self.ready = torch.zeros(B, dtype=torch.bool)
        self.error: BaseException | None = None

    def put(self, rows: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor) -> None:
        with self.sampler._cond:
            self.logp[rows], self.entropy[rows] = logp, entropy
            self.ready[rows.cpu()] = True
            self.sampler._cond.notify_all()

    def get(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropies) of `rows` (default all), once the sampler has them."""
        rows = torch.arange(len(self.ready)) if rows is None else rows
        s, ready = self.sampler, lambda: bool(self.ready[rows.cpu()].all())
        with s._cond, s._waiting(not ready()):
            while not ready():
                if self.error is not None:
                    raise self.error
                if s._error is not None:  # the sampler's own failure, as `take` raises it
                    raise s._error
                if not s._thread.is_alive():
                    raise RuntimeError("the rollout sampler thread ended before pi_old's "
                                       "recompute")
                s._cond.wait(WAIT_POLL_S)
            return self.logp[rows], self.entropy[rows]


class AsyncSampler:
    """Samples step m's batch from weight version max(start, m - k) in a background thread,
    for the steps before `end` (the run's last step: none past it, whose sampling and scoring
    the final evaluation and close() would wait for, to no use).

    produce(step, hold) -> Batch: runs in the sampler's thread (no collectives) and uses the
    engine only inside `with hold():`, which holds it with the step's weights loaded (an
    evaluation borrows it between two such blocks; the next reloads them). The sampler sets
    the batch's version. Between two batches it runs the trainer's jobs (`recompute`).
    """

    def __init__(self, engine, staleness: int, start: int,
                 weights: Iterable[tuple[str, torch.Tensor]],
                 produce: Callable[[int, Callable[[], contextlib.AbstractContextManager]], Batch],
                 threads: int | None = None, cores: CoreShare | None = None,
                 end: int | None = None):
        if staleness < 1:
            raise ValueError(f"max_staleness={staleness}: the sampler runs ahead by 1 or more")
        self.engine, self.k, self.start, self.end = engine, staleness, start, end
        self._make, self._threads, self.cores = produce, threads, cores
        if hasattr(engine, "on_step"):  # called in whichever thread decodes (evaluation's too)
            engine.on_step = self._on_decode_step
        self._cond = threading.Condition()
        self._engine_lock = threading.Lock()  # the engine is the sampler's, or evaluation's
        # version -> its weights: `start`'s (the engine holds them too, until an evaluation
        # borrows it) and each published one, until no batch left needs it
        self._snapshots = {start: _snapshot(weights)}
        self._published = start
        self._engine_version: int | None = start
        self._batches: dict[int, Batch] = {}
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        # rollout.sampler_recomputes: the trainer's jobs, (version, work, rows), run between
        # two batches; with `jobs_each_step`, one a step, which the batch sampled from the
        # same version waits for (the trainer needs it first)
        self.jobs_each_step = False
        self._jobs: list[tuple[int, Callable, Rows]] = []
        self._last_job = start - 1

    def version_for(self, step: int) -> int:
        return max(self.start, step - self.k)

    # ---- the trainer's side

    def take(self, step: int) -> Batch:
        """Step `step`'s batch, waiting for it (the sampler starts on the first call)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="gspo-sampler",
                                            daemon=True)
            self._thread.start()
        with self._cond, self._waiting(step not in self._batches):
            while step not in self._batches:
                if self._error is not None:
                    raise self._error
                if not self._thread.is_alive():
                    raise RuntimeError("the rollout sampler thread ended without a batch")
                self._cond.wait(WAIT_POLL_S)
            return self._batches.pop(step)

    def publish(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Version `version` of the policy (after `version` updates), copied now: the trainer
        goes on changing its weights in place."""
        snapshot = _snapshot(weights)
        if self.cores is not None and self._thread is not None and self._thread.is_alive():
            self.cores.wake(SAMPLER)
        with self._cond:
            self._snapshots[version] = snapshot
            self._published = version
            self._cond.notify_all()

    def recompute(self, version: int, work: Callable, B: int, T: int,
                  device: torch.device | str = "cpu") -> Rows:
        """Step `version`'s job for the sampler's thread: work(engine, rows, checkpoint) with
        the engine holding weight version `version` (the trainer's current ones), filling
        `rows` (B rows of T tokens, on `device`) as it goes and calling checkpoint() between
        its parts."""
        rows = Rows(self, B, T, device)
        with self._cond:
            self._jobs.append((version, work, rows))
            self._last_job = version
            self._cond.notify_all()
        return rows

    @contextlib.contextmanager
    def borrow(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The engine with these weights (the trainer's current ones) for the duration, the
        sampler paused after its current batch; the sampler reloads its version afterwards."""
        with self._engine_lock:
            self.engine.load_weights(weights)
            self._engine_version = None
            yield self.engine

    def close(self, timeout: float = 600.0) -> None:
        """Stop after the current batch, or at its next decode step where the engine has
        `on_step` (waited for up to `timeout` s: the engine is closed next, and must not be
        sampling), then drop what refers back to the run (a thread still
        running past the timeout keeps it)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            # the producer closes over the run, which holds this sampler: a reference cycle
            # that kept the model, its DDP / FSDP2 wrapper and the process group's state alive
            # until the garbage collector ran, at times during interpreter exit, where tearing
            # gloo down aborted a rank ("terminate called without an active exception")
            # (a failure's traceback too: its frames hold this sampler and the run)
            self._make, self._error = None, None
            self._snapshots.clear()
            if getattr(self.engine, "on_step", None) == self._on_decode_step:
                self.engine.on_step = None
            if self.cores is not None:
                self.cores.close()
            self._batches.clear()

    # ---- the sampler's side

    def _on_decode_step(self) -> None:
        """Before each forward of a decode: the batch in flight is abandoned once the run
        closes (a SIGTERM's exit waits for no more than a decode step of it), and the thread
        takes the threads its role has now."""
        if self._closing and threading.current_thread() is self._thread:
            raise _Abandoned
        if self.cores is not None and self.cores.lend:
            self.cores.adjust()

    def _produce(self) -> None:
        # OpenMP's thread count is per thread: a new one starts at the machine's default,
        # not torch's setting (vLLM's CPU attention checks that the two agree)
        if self.cores is not None:
            self.cores.join(SAMPLER)
        else:
            torch.set_num_threads(self._threads or torch.get_num_threads())
        step = self.start
        try:
            while True:
                version = self.version_for(step)
                ready = lambda: self._jobs or self._may_sample(step)  # noqa: E731
                with self._cond, self._waiting(not ready()):
                    while not (ready() or self._closing):
                        self._cond.wait(WAIT_POLL_S)
                    if self._closing:
                        return
                    if self._jobs:
                        job = self._jobs.pop(0)
                    else:
                        job, snapshot = None, self._snapshots[version]
                if job is not None:
                    self._run_job(*job)
                    continue
                batch = self._make(step, lambda: self._engine_at(version, snapshot))
                batch.version = version
                with self._cond:
                    self._batches[step] = batch
                    # versions no batch from step + 1 on will be sampled from
                    for v in [v for v in self._snapshots if v < self.version_for(step + 1)]:
                        del self._snapshots[v]
                    self._cond.notify_all()
                step += 1
        except _Abandoned:
            return
        except BaseException as e:  # handed to the trainer's next take
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            if self.cores is not None:  # the trainer has the cores to itself from now on
                self.cores.leave()

    def _may_sample(self, step: int) -> bool:
        """Step `step`'s batch may be sampled now: a step of the run, its weights published,
        and (one job each step) the job of the step that needs the same weights arrived."""
        version = self.version_for(step)
        return ((self.end is None or step < self.end) and self._published >= version
                and not (self.jobs_each_step and step > version > self._last_job))

    def _run_job(self, version: int, work: Callable, rows: Rows) -> None:
        try:
            with self._engine_at(version, self._snapshots[version]) as engine:
                work(engine, rows, self._on_decode_step)  # its checkpoint, as a decode step's
        except _Abandoned:
            raise
        except BaseException as e:  # the trainer's, raised where it waits for the rows
            with self._cond:
                rows.error = e
                self._cond.notify_all()

    def _waiting(self, waits: bool) -> contextlib.AbstractContextManager:
        """The calling thread waits, when `waits`, for the duration (its cores go to the
        other)."""
        return self.cores.waiting() if waits and self.cores is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _engine_at(self, version: int, snapshot: list[tuple[str, torch.Tensor]]):
        """The engine, held against evaluation, with version `version`'s weights."""
        with self._waiting(self._engine_lock.locked()):  # an evaluation has it
            self._engine_lock.acquire()
        try:
            if self._engine_version != version:
                self.engine.load_weights(snapshot)
                self._engine_version = version
            yield self.engine
        finally:
            self._engine_lock.release()


class _Abandoned(Exception):
    """The sampler's batch in flight, abandoned because the sampler closes."""


def _snapshot(weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return [(name, t.detach().clone()) for name, t in weights]
