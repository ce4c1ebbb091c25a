"""Asynchronous rollouts (rollout.max_staleness): which weights each batch is sampled from,
whatever the threads' timing, and the trainer's run against a sequential re-enactment."""

import gc
import random
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

import gspo.preflight as preflight
import gspo.step as step_mod
import gspo.trainer as trainer
from gspo import metrics as M
from gspo.async_rollouts import SAMPLER, TRAINER, AsyncSampler, Batch, CoreShare, Rows
from gspo.engines.hf import HFEngine, has_hooks
from gspo.engines import SamplingParams
from gspo.config import load_config
from gspo.errors import TrainingError
from gspo.logger import read_metrics
from gspo.models import build_tiny_qwen3, build_tokenizer


class VersionEngine:
    """Holds one weight, `w`; a batch records the value it was sampled with."""

    def __init__(self, value: float):
        self.w = torch.tensor(value)
        self.loads = 0

    def load_weights(self, weights):
        for name, t in weights:
            self.w.copy_(t)
        self.loads += 1


def make_sampler(engine, k, start, published, delays, fail_at=None):
    def produce(step, hold):
        with hold():  # the engine, with the weights of the step's version
            time.sleep(delays.uniform(0, 0.01))
            seen = (float(engine.w), published[0])  # the weight, and the trainer's newest version
        if fail_at is not None and step == fail_at:  # a failure while scoring
            raise KeyError("answr")
        return Batch([{"step": step}], seen, [f"{step}"], [1.0], 0, None, version=-1,
                     rollout_s=0.0, reward_s=0.0)
    return AsyncSampler(engine, k, start, [("w", torch.tensor(float(start)))], produce)


@pytest.mark.parametrize("k,start", [(1, 0), (2, 0), (3, 5)])
def test_each_batch_is_sampled_from_exactly_version_step_minus_k(k, start):
    """The trainer's weight after v updates is v; batch m must be sampled with weight
    max(start, m - k), never later than k batches ahead of the trainer, whatever the delays."""
    rng = random.Random(k)
    w = torch.tensor(float(start))  # the trainer's weight, changed in place
    engine, published = VersionEngine(start), [start]
    sampler = make_sampler(engine, k, start, published, random.Random(k + 1))
    try:
        for step in range(start, start + 8):
            batch = sampler.take(step)
            value, newest = batch.rollouts
            assert value == max(start, step - k) == batch.version
            assert step - newest <= k  # sampled no more than k updates ahead
            time.sleep(rng.uniform(0, 0.01))  # the update
            w.add_(1.0)
            sampler.publish(step + 1, [("w", w)])
            published[0] = step + 1
            w.add_(100.0)  # the trainer goes on changing its weight in place: a copy was kept
            w.sub_(100.0)
    finally:
        sampler.close()
    assert not sampler._thread.is_alive()
    assert len(sampler._snapshots) <= k + 1  # versions no batch needs are dropped


def test_a_failure_in_the_sampler_reaches_the_trainer():
    engine, published = VersionEngine(0), [0]
    sampler = make_sampler(engine, 1, 0, published, random.Random(0), fail_at=1)
    try:
        sampler.take(0)
        sampler.publish(1, [("w", torch.tensor(1.0))])
        with pytest.raises(KeyError, match="answr"):
            sampler.take(1)
    finally:
        sampler.close()


def test_a_job_runs_on_its_versions_weights_before_the_batch_sampled_from_them():
    """rollout.sampler_recomputes: step m's job (pi_old under the trainer's weights, version
    m) runs in the sampler's thread with the engine holding version m, between two batches;
    with one job each step, the batch sampled from version m waits for it; its rows reach
    the trainer as they are filled, and a job's failure is raised where the trainer waits."""
    engine, order = VersionEngine(0), []

    def produce(step, hold):
        with hold():
            order.append(("batch", step, float(engine.w)))
        return Batch([], None, [], [], 0, None, version=-1, rollout_s=0.0, reward_s=0.0)

    def work(engine, rows, checkpoint):
        for i in range(2):
            checkpoint()
            order.append(("job", float(engine.w)))
            rows.put(torch.tensor([i]), torch.full((1, 3), float(engine.w)), torch.zeros(1, 3))

    sampler = AsyncSampler(engine, 1, 0, [("w", torch.tensor(0.0))], produce, end=3)
    sampler.jobs_each_step = True
    try:
        for step in range(3):
            sampler.take(step)
            rows = sampler.recompute(step, work, 2, 3)
            assert torch.equal(rows.get(torch.tensor([1]))[0], torch.full((1, 3), float(step)))
            sampler.publish(step + 1, [("w", torch.tensor(step + 1.0))])
        assert torch.equal(rows.get()[0], torch.full((2, 3), 2.0))
        assert order == [("batch", 0, 0.0), ("job", 0.0), ("job", 0.0), ("batch", 1, 0.0),
                         ("job", 1.0), ("job", 1.0), ("batch", 2, 1.0), ("job", 2.0),
                         ("job", 2.0)]

        def broken(engine, rows, checkpoint):
            raise KeyError("no such row")
        with pytest.raises(KeyError, match="no such row"):
            sampler.recompute(3, broken, 1, 1).get()
    finally:
        sampler.close()
    with pytest.raises(RuntimeError, match="ended before pi_old"):
        Rows(sampler, 1, 1).get()  # a closed sampler's thread computes nothing more


def test_a_batch_failure_while_the_trainer_waits_for_rows_is_raised_as_itself():
    """The sampler fails on a batch while the trainer waits for its job's rows: the trainer
    gets the batch's own exception, as `take` gives it (a GspoError stays one for the CLI)."""
    engine, published = VersionEngine(0), [0]
    sampler = make_sampler(engine, 2, 0, published, random.Random(0), fail_at=1)
    sampler.jobs_each_step = True
    try:
        sampler.take(0)
        rows = sampler.recompute(0, lambda engine, rows, checkpoint: None, 1, 1)  # fills none
        with pytest.raises(KeyError, match="answr"):
            rows.get()
    finally:
        sampler.close()


def test_close_abandons_the_batch_in_flight_at_its_next_decode_step():
    """A SIGTERM's exit need not wait for a whole sampling: an engine with on_step (the hf
    engine) is interrupted there once the sampler closes; the trainer's own decodes are not."""
    class SlowEngine(VersionEngine):
        on_step = None
        steps = 0

        def generate(self, n=200):  # 200 decode steps of 50 ms: 10 s
            for _ in range(n):
                if self.on_step is not None:
                    self.on_step()
                self.steps += 1
                time.sleep(0.05)

    engine, started = SlowEngine(0), threading.Event()

    def produce(step, hold):
        with hold():
            started.set()
            engine.generate()
        return Batch([], None, [], [], 0, None, version=-1, rollout_s=0.0, reward_s=0.0)

    sampler = AsyncSampler(engine, 1, 0, [("w", torch.tensor(0.0))], produce)
    assert engine.on_step is not None
    errors = []

    def take():  # the trainer, waiting for the batch the close abandons
        try:
            sampler.take(0)
        except RuntimeError as e:
            errors.append(str(e))

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    assert started.wait(10)
    t0 = time.monotonic()
    sampler.close()
    assert time.monotonic() - t0 < 2 and not sampler._thread.is_alive()
    assert engine.steps < 100 and sampler._error is None and engine.on_step is None
    taker.join(10)
    assert errors == ["the rollout sampler thread ended without a batch"]
    engine.on_step = sampler._on_decode_step  # a closed sampler stops only its own thread
    before = engine.steps
    engine.generate(5)
    assert engine.steps == before + 5


def test_evaluation_borrows_the_engine_with_the_current_weights():
    engine, published = VersionEngine(0), [0]
    sampler = make_sampler(engine, 1, 0, published, random.Random(0))
    try:
        sampler.take(0)
        with sampler.borrow([("w", torch.tensor(7.0))]) as borrowed:
            assert borrowed is engine and float(engine.w) == 7.0
        sampler.publish(1, [("w", torch.tensor(1.0))])
        assert sampler.take(1).rollouts[0] == 0.0  # back to version 0 after the evaluation
        sampler.publish(2, [("w", torch.tensor(2.0))])
        assert sampler.take(2).rollouts[0] == 1.0
    finally:
        sampler.close()


@pytest.mark.parametrize("lend", [True, False])
def test_a_waiting_thread_lends_its_cores_to_the_other(lend):
    """CoreShare over 4 threads, sampler 1 / trainer 3: each thread computes with its share
    while both work; at its first checkpoint after the other starts waiting it takes all 4,
    and its share again at the first one after the other works again; a sampler that has
    ended leaves the trainer all 4. lend=False: the shares, always."""
    threads = torch.get_num_threads()
    cores = CoreShare(4, {SAMPLER: 1, TRAINER: 3}, lend=lend)
    seen: list[tuple[str, int]] = []
    waits, go, back, trainer_waits, lent, done = (threading.Event() for _ in range(6))

    def sampler():
        cores.join(SAMPLER)
        seen.append(("sampler works", torch.get_num_threads()))
        with cores.waiting():
            waits.set()
            go.wait(10)
        seen.append(("sampler works again", torch.get_num_threads()))
        back.set()
        trainer_waits.wait(10)
        cores.adjust()
        seen.append(("sampler, the trainer waiting", torch.get_num_threads()))
        lent.set()
        done.wait(10)
        cores.adjust()  # the trainer has stopped waiting
        seen.append(("sampler works, the trainer too", torch.get_num_threads()))
        cores.leave()

    try:
        cores.join(TRAINER)
        seen.append(("trainer works", torch.get_num_threads()))
        t = threading.Thread(target=sampler)
        t.start()
        assert waits.wait(10)
        cores.adjust()
        seen.append(("trainer, the sampler waiting", torch.get_num_threads()))
        go.set()
        assert back.wait(10)
        cores.adjust()
        seen.append(("trainer works, the sampler too", torch.get_num_threads()))
        with cores.waiting():
            trainer_waits.set()
            assert lent.wait(10)
        seen.append(("trainer works again", torch.get_num_threads()))
        done.set()
        t.join(10)
        cores.adjust()
        seen.append(("trainer, the sampler ended", torch.get_num_threads()))
    finally:
        torch.set_num_threads(threads)
    all_, s, tr = 4, 1, 3
    if not lend:
        all_ = None
    assert seen == [("trainer works", tr), ("sampler works", s),
                    ("trainer, the sampler waiting", all_ or tr),
                    ("sampler works again", s), ("trainer works, the sampler too", tr),
                    ("sampler, the trainer waiting", all_ or s), ("trainer works again", tr),
                    ("sampler works, the trainer too", s),
                    ("trainer, the sampler ended", all_ or tr)]


def test_the_trainers_checkpoints_are_each_layers_forward_and_backward():
    """CoreShare.watch: one checkpoint before each decoder layer's forward and one after its
    backward (none in a forward without gradients); close removes them, and with lend=False
    there are none."""
    model = build_tiny_qwen3(build_tokenizer())
    n_layers = model.config.num_hidden_layers
    calls = []
    cores = CoreShare(2, {SAMPLER: 1, TRAINER: 1})
    cores.adjust = lambda: calls.append(torch.is_grad_enabled())
    cores.watch(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    with torch.no_grad():
        model(input_ids=ids)
    assert len(calls) == n_layers
    calls.clear()
    model(input_ids=ids).logits.sum().backward()
    assert len(calls) == 2 * n_layers and not all(calls)  # the backward's run without grad mode
    cores.close()
    assert not has_hooks(model)
    off = CoreShare(2, {SAMPLER: 1, TRAINER: 1}, lend=False)
    off.watch(model)
    assert not has_hooks(model)


def test_the_hf_engine_calls_on_step_before_each_forward_of_a_decode():
    """HFEngine.on_step: called once per forward (the prefill and each decode step), in both
    decoders, and the samples are those of an engine without it (a module hook would have
    turned the fast decoder's shared prefill off)."""
    tok = build_tokenizer()
    model = build_tiny_qwen3(tok)
    params = SamplingParams(max_new_tokens=6)
    prompts = [tok.encode("1+2=")] * 2 + [tok.encode("13+4=")]
    for fast in (True, False):
        engine = HFEngine(model, eos_token_ids=[-1], pad_token_id=tok.pad_token_id, fast=fast)
        plain = engine.generate(prompts, 2, params, seed=3)
        calls = []
        engine.on_step = lambda: calls.append(1)
        hooked = engine.generate(prompts, 2, params, seed=3)
        assert torch.equal(plain.response_ids, hooked.response_ids)
        assert torch.equal(plain.logp, hooked.logp)
        assert len(calls) == params.max_new_tokens  # the prefill and 5 decode steps


ASYNC = ["train.eval_every=2", "train.steps=4", "warmup.steps=10"]


def varied(completion, **_):
    """A reward that varies within groups from the start, so every update moves the weights."""
    return float(sum(map(ord, completion)) % 7)


def half_constant(completion, answer, **_):
    """Constant for the prompts with an even answer: rollout.filter_groups samples more."""
    return 1.0 if int(answer) % 2 == 0 else varied(completion)


def run_async(tmp_path, tiny_overrides, *extra, resume=False, reward_fn=varied):
    trainer.train(load_config(overrides=tiny_overrides + ASYNC + ["rollout.max_staleness=1",
                                                                  *extra]), tmp_path,
                  resume=resume, reward_fn=reward_fn)
    return read_metrics(tmp_path)


def same(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
            for r in rows]


FIXED = "rollout.share_cores=false"


@pytest.mark.parametrize("extra, reward_fn", [
    ([FIXED], varied), ([FIXED, "rollout.filter_groups=true"], half_constant), ([], varied)])
def test_an_async_run_equals_its_sequential_reenactment(tmp_path, tiny_overrides, extra,
                                                        reward_fn):
    """max_staleness=1 against the synchronous step driven by hand, the engine loaded with
    the weights of one update earlier before each step. With fixed thread shares
    (rollout.share_cores=false): the same rows, bit for bit, and a second asynchronous run
    gives the same (the threads' timing does not matter). Sharing the cores (the default),
    a thread computes with 1 or 2 threads as the other's timing has it, which moves a
    kernel's last bits: the same rows to 1e-4. With rollout.filter_groups the sampler thread
    samples in rounds, and the evaluations may borrow the engine between them."""
    exact = FIXED in extra
    threads = torch.get_num_threads()
    try:
        rows = run_async(tmp_path / "a", tiny_overrides, *extra, reward_fn=reward_fn)
        if exact:
            assert same(run_async(tmp_path / "b", tiny_overrides, *extra,
                                  reward_fn=reward_fn)) == same(rows)
        # the reference: one thread's worth of compute as each async thread had
        torch.set_num_threads(max(1, threads // 2))
        cfg = load_config(overrides=tiny_overrides + ASYNC + extra)
        run = trainer.prepare(cfg, tmp_path / "ref", resume=False, reward_fn=reward_fn)
        try:
            run.engine = trainer.build_engine(run.model, run.tokenizer, cfg, own_copy=True)
            first = trainer.run_eval(run)
            weights = [[(n, t.detach().clone()) for n, t in run.model.state_dict().items()]]
            ref = []
            for step in range(4):
                run.engine.load_weights(weights[max(0, step - 1)])
                row = step_mod.rl_step(run, step)
                weights.append([(n, t.detach().clone())
                                for n, t in run.model.state_dict().items()])
                if (step + 1) % 2 == 0:
                    row.update(trainer.run_eval(run))
                ref.append(row)
        finally:
            trainer.close_run(run)
    finally:
        torch.set_num_threads(threads)
    assert rows[0] == {"step": 0, **first}
    assert [r[M.STALENESS] for r in rows[1:]] == [0, 1, 1, 1]
    got = [{k: v for k, v in r.items() if k not in ("step", M.STALENESS)} for r in rows[1:]]
    if exact:
        assert same(got) == same(ref)
    else:
        assert [sorted(r) for r in same(got)] == [sorted(r) for r in same(ref)]
        for g, r in zip(same(got), same(ref)):
            assert g == {k: pytest.approx(v, rel=1e-4, abs=1e-6) for k, v in r.items()}
    assert not torch.equal(weights[0][0][1], weights[1][0][1])  # the updates moved weights
    if "rollout.filter_groups=true" in extra:
        assert sum(r[M.EXTRA_PROMPTS] for r in rows[1:]) > 0  # it sampled extra rounds


def test_pi_old_recomputed_in_the_sampler_thread_is_the_trainers_own(tmp_path, tiny_overrides,
                                                                     monkeypatch):
    """rollout.sampler_recomputes (the default): the trainer makes no pi_old forward of its
    own, and the run's rows equal those of the trainer's recompute (fixed shares: the same
    thread counts) to float32's last bits."""
    calls, puts = [], []
    real, put = step_mod.policy_logprobs, Rows.put
    monkeypatch.setattr(step_mod, "policy_logprobs",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(Rows, "put", lambda self, rows, *a: puts.append(
        (threading.current_thread().name, len(rows))) or put(self, rows, *a))
    rows = run_async(tmp_path / "a", tiny_overrides, FIXED)
    assert calls == []
    # the first minibatch's rows come from the trainer's own forward (at theta_old still), the
    # others' from the sampler's: a quarter and three quarters of each step's rows
    cfg = load_config(overrides=tiny_overrides)
    B, parts = cfg.rollout.prompts_per_step * cfg.rollout.group_size, cfg.algorithm.minibatches
    by = {name: sum(n for who, n in puts if who == name) for name in ("MainThread", "gspo-sampler")}
    assert by == {"MainThread": 4 * B // parts, "gspo-sampler": 4 * (B - B // parts)}
    ref = run_async(tmp_path / "b", tiny_overrides, FIXED, "rollout.sampler_recomputes=false")
    assert len(calls) == 4  # one recompute a step
    assert [sorted(r) for r in same(rows)] == [sorted(r) for r in same(ref)]
    for got, want in zip(same(rows), same(ref)):
        assert got == {k: pytest.approx(v, rel=1e-5, abs=1e-6) for k, v in want.items()}


def test_the_sampler_recomputes_only_where_its_copy_computes_what_the_trainer_would(
        tmp_path, tiny_overrides):
    def split(*extra):
        run = trainer.prepare(load_config(overrides=tiny_overrides + [
            "warmup.steps=0", "rollout.max_staleness=1", *extra]),
            tmp_path / str(len(list(tmp_path.iterdir()))), resume=False)
        try:
            return step_mod.sampler_recomputes(run)
        finally:
            trainer.close_run(run)

    assert split()
    assert not split("rollout.sampler_recomputes=false")
    assert not split("algorithm.old_logprobs=rollout")
    assert not split("rollout.dtype=bfloat16")  # the copy computes in another dtype
    assert not split("model.lora_rank=4")  # the copy holds the merged weights
    assert not split("model.name_or_path=tiny-qwen3-moe")  # pi_old's routing is recorded


def test_a_resumed_async_run_loses_no_update(tmp_path, tiny_overrides):
    """In-flight rollouts are not saved: the first step after a resume samples from the
    weights it resumed with (staleness 0), and every step is there once."""
    threads, alive = torch.get_num_threads(), threading.active_count()  # earlier tests' too
    run_async(tmp_path, tiny_overrides, "train.steps=2")
    rows = run_async(tmp_path, tiny_overrides, resume=True)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r[M.STALENESS] for r in rows[1:]] == [0, 1, 0, 1]
    assert threading.active_count() == alive  # the sampler threads ended with their runs
    assert torch.get_num_threads() == threads  # and torch has its threads back


def test_the_sampler_samples_no_step_past_the_runs_last(tmp_path, tiny_overrides, monkeypatch):
    """train.steps=4: steps 0-3 are sampled, once each; none past them, whose batches the final
    evaluation and the sampler's close would wait for (k + 1 of them), scoring them besides."""
    sampled = []

    def spy(run, step, *args, **kwargs):
        sampled.append(step)
        return step_mod.sample_batch(run, step, *args, **kwargs)

    monkeypatch.setattr(trainer, "sample_batch", spy)
    for k in (1, 2):
        sampled.clear()
        run_async(tmp_path / f"k{k}", tiny_overrides, f"rollout.max_staleness={k}")
        assert sorted(sampled) == [0, 1, 2, 3]


def test_a_closed_sampler_keeps_no_reference_to_its_producer_even_after_a_failure():
    """A failed batch's traceback holds the producer's frames (and through them the run):
    close() drops it with the producer, so nothing of the run waits for the collector."""
    class Owner:  # stands for the run: it holds the sampler, whose producer refers back to it
        def produce(self, step, hold):
            raise ValueError("no batch")

    gc.collect()
    gc.disable()
    try:
        owner = Owner()
        owner.sampler = AsyncSampler(VersionEngine(0.0), 1, 0, [("w", torch.tensor(0.0))],
                                     owner.produce)
        with pytest.raises(ValueError, match="no batch"):
            owner.sampler.take(0)
        owner.sampler.close()
        alive = weakref.ref(owner)
        del owner
        assert alive() is None  # freed by reference counting alone
    finally:
        gc.enable()


def runs_alive() -> int:
    """How many gspo Run objects exist (the collector sees them all)."""
    from gspo.run import Run
    return sum(isinstance(o, Run) for o in gc.get_objects())


def test_a_finished_async_run_leaves_nothing_for_the_garbage_collector(tmp_path, tiny_overrides):
    """The run (model, optimiser, engine, a DDP wrapper's process-group state) is freed when
    train() returns, by reference counting: left in a reference cycle it lived until the
    collector ran, at times during interpreter exit, where gloo's teardown aborted a torchrun
    rank ("terminate called without an active exception") in about 1 run in 30."""
    gc.collect()
    before = runs_alive()
    gc.disable()
    try:
        run_async(tmp_path, tiny_overrides)
        assert runs_alive() == before
    finally:
        gc.enable()


@pytest.mark.parametrize("extra, why", [
    (["algorithm.routing_replay=true"], "algorithm.routing_replay"),
    (["rollout.engine=vllm", "rollout.vllm_sleep=true"], "rollout.vllm_sleep"),
])
def test_what_async_does_not_run_with_is_refused(extra, why, tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + ["rollout.max_staleness=1", *extra])
    with pytest.raises(TrainingError, match=f"rollout.max_staleness=1 does not run with {why}"):
        preflight.check_launch(cfg, world=1)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_async_rollouts_under_torchrun(tmp_path, tiny_overrides, mode):
    """Each rank's sampler thread samples its share; every collective (the weights' gather for
    a snapshot, evaluation's reduction) stays in the trainers' threads; the ranks exit cleanly."""
    from test_distributed import launch
    overrides = [o for o in tiny_overrides + ASYNC if not o.startswith("train.steps")]
    out = launch(2, "-m", "gspo", "train", "--output-dir", str(tmp_path), *overrides,
                 "train.steps=3", "rollout.max_staleness=1", f"train.data_parallel={mode}",
                 timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "terminate called" not in out.stderr
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r[M.STALENESS] for r in rows[1:]] == [0, 1, 1]
    assert all(M.EVAL_ACCURACY in r for r in (rows[0], rows[2], rows[3]))


def test_sigterm_stops_an_async_run_with_a_checkpoint_and_a_resume_goes_on(tmp_path):
    from test_run_control import finish, start, steps_logged, wait_for
    run = tmp_path / "run"
    proc = start(run, "train.steps=100000", "rollout.max_staleness=2", "train.save_every=0")
    wait_for(lambda: steps_logged(run) >= 2, proc=proc)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    done = steps_logged(run)
    assert code == 143 and f"gspo: stopped by SIGTERM after {done} of 100000 RL steps" in err
    out = subprocess.run([sys.executable, "-m", "gspo", "train", "--resume", str(run),
                          f"train.steps={done + 3}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [r for r in read_metrics(run) if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, done + 4))
    assert [r[M.STALENESS] for r in rows[done:]] == [0, 1, 2]  # the resumed run starts afresh
