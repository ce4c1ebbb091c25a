"""Data parallelism under torchrun with gloo on CPU: N ranks x M micro-batches must give the
same update as one process with the whole batch; end-to-end runs and resume across world size."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gspo import metrics as M
from gspo.distributed import Dist
from gspo.logger import read_metrics
from test_bad_inputs import (QUICK, USER, _tear_a_middle_line, _without_metrics_copies,
                             finished_run, snapshot)  # noqa: F401  (finished_run: a fixture)

WORKER = Path(__file__).with_name("dist_update_worker.py")
MODEL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64", "data.n_train=200", "data.n_eval=8", "warmup.steps=2",
         "warmup.batch_size=4", "train.progress=false", "train.tensorboard=false",
         "train.dist_timeout_s=120"]  # a rank left waiting fails well inside the test's timeout


def launch(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """torchrun with nproc ranks (a plain process for 1), bounded: past `timeout` the whole
    process group (the agent and every rank) is killed and the test fails with its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT below: every process prints its threads' stacks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *args] if nproc > 1 else [sys.executable, *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGABRT)  # where each process hangs, into the failure message
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(p.pid, signal.SIGKILL)  # ranks are the agent's children: kill them all
        stdout, stderr = p.communicate()  # everything read since the start
        pytest.fail(f"{' '.join(cmd[:6])} ran past {timeout} s and was killed:\n"
                    f"{stdout[-3000:]}{stderr[-8000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)


def torchrun(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    out = launch(nproc, *args, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """one_process(*args): the worker's result on one process for those args, run once per
    module: several tests (and both modes of each) compare two ranks against the same
    single-process reference, and each launch costs seconds of start-up"""
    root, done = tmp_path_factory.mktemp("one_process"), {}

    def result(*args: str) -> dict:
        if args not in done:
            out = root / f"{len(done)}.pt"
            torchrun(1, str(WORKER), str(out), *args)
            done[args] = out
        return torch.load(done[args])
    return result


GSPO = ["algorithm=gspo"]
GRPO_TOKEN_MEAN = ["algorithm=grpo", "algorithm.aggregation=token-mean"]


# each aggregation once and each mode once in CI; the other two pairs add no code path
@pytest.mark.parametrize("aggregation, mode", [
    pytest.param(GSPO, "fsdp", id="gspo-fsdp"),
    pytest.param(GRPO_TOKEN_MEAN, "ddp", id="grpo-token-mean-ddp"),
    pytest.param(GSPO, "ddp", id="gspo-ddp", marks=pytest.mark.slow),
    pytest.param(GRPO_TOKEN_MEAN, "fsdp", id="grpo-token-mean-fsdp", marks=pytest.mark.slow)])
def test_two_ranks_give_the_single_process_update(tmp_path, one_process, aggregation, mode):
    # 16 sequences, one optimiser step; 2 ranks x 4 micro-batches of 2 vs 1 process x 1 batch
    common = MODEL + aggregation + ["rollout.prompts_per_step=4", "rollout.group_size=4",
                                    "algorithm.minibatches=1"]
    one = one_process(*common)
    torchrun(2, str(WORKER), str(tmp_path / "two.pt"), *common, "algorithm.micro_batch_size=2",
             f"train.data_parallel={mode}")
    two = torch.load(tmp_path / "two.pt")
    assert two["sharded"] == (mode == "fsdp") and not one["sharded"]
    for k, v in one["params"].items():
        torch.testing.assert_close(two["params"][k], v, rtol=0, atol=1e-5, msg=k)
    # Adam's first step barely depends on the gradient's scale: compare the gradients too
    for k, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][k], g, rtol=1e-4, atol=1e-7, msg=k)
    for k in (M.LOSS, M.CLIP_FRAC, M.RATIO_MEAN, M.RATIO_MIN, M.RATIO_MAX, M.KL_OLD, M.GRAD_NORM):
        assert two["metrics"][k] == pytest.approx(one["metrics"][k], abs=1e-5), k
    assert one["metrics"][M.GRAD_NORM] > 0


def test_two_ranks_packing_different_numbers_of_micro_batches_give_the_single_process_update(
        tmp_path, one_process):
    # train.max_tokens_per_micro=18 over the worker's batch (prompt width 5; rank 0's responses
    # shorter than rank 1's) packs 4 micro-batches on rank 0 and 6 on rank 1. DDP runs them as
    # they are: one synchronised backward per rank per minibatch, whatever the count. FSDP2
    # cannot (each forward and backward of a sharded layer is a collective): every rank packs
    # the all-reduced max, 6
    from dist_update_worker import fixed_batch
    from gspo.models import build_tokenizer
    from gspo.packing import pack_by_tokens
    lengths = fixed_batch(16, len(build_tokenizer()))[0].response_lengths.tolist()
    assert [len(pack_by_tokens(lengths[k * 8:(k + 1) * 8], 5, 18, 4)[0]) for k in (0, 1)] == [4, 6]
    common = MODEL + ["algorithm=gspo", "rollout.prompts_per_step=4", "rollout.group_size=4",
                      "algorithm.minibatches=1"]
    one = one_process(*common)
    for mode in ("ddp", "fsdp"):
        torchrun(2, str(WORKER), str(tmp_path / f"{mode}.pt"), *common,
                 "train.max_tokens_per_micro=18", f"train.data_parallel={mode}")
        two = torch.load(tmp_path / f"{mode}.pt")
        assert two["sharded"] == (mode == "fsdp")
        for k, g in one["grads"].items():
            torch.testing.assert_close(two["grads"][k], g, rtol=1e-4, atol=1e-7, msg=f"{mode} {k}")
        for k, v in one["params"].items():
            torch.testing.assert_close(two["params"][k], v, rtol=0, atol=1e-5, msg=f"{mode} {k}")
        for k in (M.LOSS, M.RATIO_MEAN, M.KL_OLD, M.GRAD_NORM):
            assert two["metrics"][k] == pytest.approx(one["metrics"][k], abs=1e-5), (mode, k)


@pytest.mark.parametrize("mode,precision", [("fsdp", "bf16-mixed"), ("ddp", "bf16-mixed"),
                                            ("fsdp", "fp16-mixed")])
def test_mixed_precision_on_two_ranks_gives_the_single_process_gradient(tmp_path, one_process,
                                                                        mode, precision):
    # DDP autocasts each rank's forward as one process does; FSDP2 gathers bf16 / fp16
    # parameters (MixedPrecisionPolicy) and reduce-scatters float32 gradients into float32
    # shards; fp16's loss scaler unscales the sharded gradients
    common = MODEL + ["algorithm=gspo", "rollout.prompts_per_step=4", "rollout.group_size=4",
                      "algorithm.minibatches=1", f"train.precision={precision}"]
    one, fp32 = one_process(*common), one_process(*common[:-1])
    torchrun(2, str(WORKER), str(tmp_path / "two.pt"), *common, "algorithm.micro_batch_size=2",
             f"train.data_parallel={mode}")
    two = torch.load(tmp_path / "two.pt")
    assert all(v.dtype == torch.float32 for v in two["params"].values())  # master weights
    flat = lambda d: torch.cat([d[k].flatten().double() for k in sorted(d)])  # noqa: E731
    g1, g2, g32 = flat(one["grads"]), flat(two["grads"]), flat(fp32["grads"])
    assert all(g.dtype == torch.float32 for g in two["grads"].values())
    cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))  # noqa: E731
    # measured (2026-12-05), two ranks vs one process / vs float32: fsdp bf16 0.99996 / 0.99995,
    # ddp bf16 0.999994 / 0.99997 (micro-batches of other widths round differently), fsdp fp16
    # 0.9999995 / 0.9999996; one process bf16 vs float32 0.99997
    assert cos(g2, g1) > (0.9999 if mode == "ddp" else 0.999)
    assert cos(g2, g32) > 0.999 and cos(g1, g32) > 0.999
    assert two["metrics"][M.GRAD_NORM] == pytest.approx(one["metrics"][M.GRAD_NORM], rel=1e-2)


def test_two_process_train_then_resume_on_one(tmp_path):
    run_dir = tmp_path / "run"
    args = MODEL + ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
                    "train.steps=2", "train.eval_every=1", "train.eval_k=2", "train.save_every=1"]
    torchrun(2, "-m", "gspo", "train", "--output-dir", str(run_dir), *args)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]  # rank 0 alone writes, once per step
    ckpt = run_dir / "checkpoints" / "step_000002"
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(ckpt)  # the same Hugging Face format as 1 process
    # resume the 2-rank run in a single process
    torchrun(1, "-m", "gspo", "train", "--resume", str(run_dir), "train.steps=3")
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]


@pytest.mark.slow  # out of CI: test_dryrun checks the same messages from the same check_launch
def test_prompts_not_divisible_by_ranks_is_a_clear_error(tmp_path):
    env_args = MODEL + ["rollout.prompts_per_step=3", "rollout.group_size=4",
                        "algorithm.minibatches=1", "train.steps=1"]
    out = launch(2, "-m", "gspo", "train", "--output-dir", str(tmp_path / "r"), *env_args)
    assert out.returncode != 0 and "divisible by the 2 ranks" in out.stderr
    # 2 x 2 rollouts: 2 per rank, fewer than the 4 minibatches the config asks for
    out = launch(2, "-m", "gspo", "train", "--output-dir", str(tmp_path / "r2"), *MODEL,
                 "rollout.prompts_per_step=2", "rollout.group_size=2", "train.steps=1")
    assert out.returncode != 0 and "each of the 2 ranks holds 2 rollouts per step, which is " \
        "not divisible by algorithm.minibatches=4" in out.stderr, out.stderr[-2000:]


def test_a_rank_that_stops_answering_fails_the_run_within_the_timeout(tmp_path):
    # rank 1 stalls inside its reward function; rank 0 waits in the next collective, gives up
    # after train.dist_timeout_s with one line naming it, and torchrun then stops rank 1. Rank 1
    # abandons the stalled call after data.reward_fn_timeout (longer than rank 0's wait), and
    # then fails at its own next collective: without it rank 1 would sit in the call through
    # torchrun's 30 s grace period (its SIGTERM only flags a stop) until torchrun's SIGKILL
    args = MODEL + ["rollout.prompts_per_step=2", "rollout.group_size=2", "warmup.steps=0",
                    "algorithm.minibatches=1", "train.steps=1", "train.eval_every=0",
                    "train.dist_timeout_s=5", "data.reward_fn_timeout=10",
                    f"data.reward={WORKER}:stalls_on_rank_1"]
    t0 = time.monotonic()
    out = launch(2, "-m", "gspo", "train", "--output-dir", str(tmp_path / "r"), *args, timeout=120)
    assert out.returncode != 0
    assert "gspo: error: rank 0: a collective failed" in out.stderr, out.stderr[-3000:]
    assert "train.dist_timeout_s=5" in out.stderr
    assert time.monotonic() - t0 < 90  # the 5 s timeout, plus start-up, not a hang


def test_filter_groups_on_two_ranks_counts_every_rank_s_rounds(tmp_path, monkeypatch):
    # each rank fills its own share in as many rounds as it needs (no collective while it
    # samples); the step's counts are the sums of what each rank's reward calls say
    log = tmp_path / "calls"
    args = MODEL + ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
                    "algorithm.minibatches=2", "train.steps=1", "train.eval_every=0",
                    "train.save_every=0", "rollout.filter_groups=true",
                    "rollout.filter_max_rounds=3", "data.reward_fn_timeout=0",
                    f"data.reward={Path(USER)}:even_answers_constant_logged"]
    monkeypatch.setenv("GSPO_TEST_REWARD_LOG", str(log))  # launch passes os.environ on
    torchrun(2, "-m", "gspo", "train", "--output-dir", str(tmp_path / "run"), *args)
    want = {M.FILTERED_GROUPS: 0, M.EXTRA_PROMPTS: 0, M.FILLED_GROUPS: 0}
    for rank in range(2):
        values = [float(x) for x in Path(f"{log}.{rank}").read_text().split()]
        groups = [values[i:i + 4] for i in range(0, len(values), 4)]
        varying = sum(len(set(g)) > 1 for g in groups)
        filled = max(0, 2 - varying)  # each rank's share: 2 prompts
        assert len(groups) <= (1 + 3) * 2  # the bound
        want[M.FILTERED_GROUPS] += len(groups) - varying - filled
        want[M.EXTRA_PROMPTS] += len(groups) - 2
        want[M.FILLED_GROUPS] += filled
    (row,) = read_metrics(tmp_path / "run")
    assert {k: row[k] for k in want} == want
    assert want[M.FILTERED_GROUPS] + want[M.FILLED_GROUPS] > 0  # some group was constant


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(ckpt / "model.safetensors")


def test_fsdp_checkpoint_resumes_exactly_under_fsdp_and_ddp(tmp_path):
    # an uninterrupted 2-rank FSDP run vs the same run resumed from its step-1 checkpoint, once
    # sharded again (the gathered optimiser state scattered back) and once under DDP
    import shutil
    args = MODEL + ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
                    "train.steps=2", "train.eval_every=0", "train.save_every=1", "train.keep_last=0",
                    "optim.lr=3e-3", "algorithm.minibatches=2", f"data.reward={WORKER}:digit_fraction"]
    full = tmp_path / "full"
    torchrun(2, "-m", "gspo", "train", "--output-dir", str(full), *args, "train.data_parallel=fsdp")
    ref = read_metrics(full)
    assert [r["step"] for r in ref] == [1, 2]
    for mode in ("fsdp", "ddp"):
        run = tmp_path / mode
        shutil.copytree(full, run)
        shutil.rmtree(run / "checkpoints" / "step_000002")
        (run / "checkpoints" / "latest").write_text("step_000001\n")
        torchrun(2, "-m", "gspo", "train", "--resume", str(run), *args,
                 f"train.data_parallel={mode}")
        rows = read_metrics(run)
        assert [r["step"] for r in rows] == [1, 2]
        for k in (M.REWARD_MEAN, M.LOSS, M.GRAD_NORM, M.CLIP_FRAC, M.RATIO_MEAN, M.KL_OLD):
            assert rows[1][k] == pytest.approx(ref[1][k], rel=1e-4, abs=1e-6), (mode, k)
        want = _weights(full / "checkpoints" / "step_000002")
        got = _weights(run / "checkpoints" / "step_000002")
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-6, msg=k)
    # the step-2 update moved the weights by far more than that tolerance
    moved = _weights(full / "checkpoints" / "step_000001")
    assert max(float((want[k] - moved[k]).abs().max()) for k in want) > 1e-3


class TwoRanks(Dist):
    """Rank 1 of a simulated 2-rank group: each collective combines this rank's values with
    what rank 0 passed to the same call (recorded by a world-1 run of the same code)."""

    def __init__(self, rank0_calls: list):
        super().__init__(rank=1, world=2)
        object.__setattr__(self, "rank0", iter(rank0_calls))

    def sum(self, values):
        return [a + b for a, b in zip(next(self.rank0), values, strict=True)]

    def max(self, values):
        return [max(a, b) for a, b in zip(next(self.rank0), values, strict=True)]


class Recording(Dist):
    def __init__(self):
        super().__init__()
        object.__setattr__(self, "calls", [])

    def sum(self, values):
        self.calls.append(list(values))
        return list(values)

    max = sum


def test_mismatch_metrics_reduced_over_ranks_equal_the_whole_batch():
    from gspo.objectives import engine_mismatch
    from gspo.engines import Rollouts
    from gspo.step import reduce_mismatch
    g = torch.Generator().manual_seed(0)
    B, T = 10, 7
    logp, rollout_logp = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    lengths = torch.tensor([7, 1, 3, 2, 7, 5, 1, 4, 6, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    whole = {k: float(v) for k, v in engine_mismatch(logp, rollout_logp, mask).items()}
    halves = []
    for rows in (slice(0, 3), slice(3, B)):  # unequal shares, so a mean of means is wrong
        n = mask[rows].shape[0]
        r = Rollouts(torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                     torch.zeros_like(mask[rows], dtype=torch.long), mask[rows], rollout_logp[rows])
        halves.append((r, {k: float(v) for k, v in
                           engine_mismatch(logp[rows], rollout_logp[rows], mask[rows]).items()}))
    rec = Recording()
    reduce_mismatch(halves[0][1], halves[0][0], rec)
    got = reduce_mismatch(halves[1][1], halves[1][0], TwoRanks(rec.calls))
    assert got == pytest.approx(whole, rel=1e-6)
    naive = (halves[0][1]["token_abs_mean"] + halves[1][1]["token_abs_mean"]) / 2
    assert naive != pytest.approx(whole["token_abs_mean"], rel=1e-3)


def test_expert_counts_add_over_ranks_to_the_whole_batch_load():
    from gspo.moe import expert_counts, load_stats, load_summary
    g = torch.Generator().manual_seed(0)
    idx = [torch.randint(0, 6, (8, 5, 2), generator=g) for _ in range(3)]  # 3 layers, top-2 of 6
    mask = (torch.rand(8, 5, generator=g) > 0.3).float()
    parts = [expert_counts([i[rows] for i in idx], mask[rows], 6)
             for rows in (slice(0, 2), slice(2, 8))]
    assert load_summary(parts[0] + parts[1]) == pytest.approx(load_stats(idx, mask, 6))


@pytest.mark.parametrize("env, says", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a number of ranks")])
def test_a_world_size_without_torchrun_is_a_clear_error(tmp_path, capsys, monkeypatch, env,
                                                        says):
    # a WORLD_SIZE left exported (e.g. from planning with --dry-run) and a plain `gspo train`:
    # one line naming what is missing and the two fixes, not torch's env:// traceback
    from test_bad_inputs import fails_cleanly
    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    last = fails_cleanly(capsys, "train", "--output-dir", str(tmp_path / "r"), *QUICK, says=says)
    assert "torchrun --nproc_per_node" in last and "unset WORLD_SIZE" in last
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_signal_during_the_join_ends_the_rank_at_once(monkeypatch):
    """The join waits in C++ and would see a stop request only when it returns: a rank whose
    peer failed before joining (rank 0 finding the run directory busy) sat through torchrun's
    SIGTERM until its SIGKILL (~37 s measured; ~7 s with this). During the join the signals
    take their default action; the run's own handlers are back after it."""
    import torch.distributed as dist

    from gspo import distributed
    seen = {}

    def join(*args, **kwargs):
        seen.update({s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)})

    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", join)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    mine = lambda signum, frame: None  # noqa: E731  (a StopRequest's, say)
    before = {s: signal.signal(s, mine) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        d = distributed.init_distributed("cpu")
        after = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert (d.rank, d.world) == (1, 2)
    assert seen == {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.SIG_DFL}
    assert after == {signal.SIGTERM: mine, signal.SIGINT: mine}


@pytest.mark.parametrize("spec, message", [("cuda", "no CUDA device"), ("cuda:1", "no CUDA device"),
                                           ("tpu", "not a device"), ("meta", "only cpu and cuda")])
def test_a_device_this_machine_lacks_is_a_clear_error(spec, message):
    from gspo.config import ConfigError
    from gspo.distributed import resolve_device
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigError, match=message):
        resolve_device(spec)
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")


@pytest.mark.parametrize("mode", ["fsdp", pytest.param("ddp", marks=pytest.mark.slow)])
def test_ranks_start_from_rank_0s_weights(tmp_path, one_process, mode):
    # a run whose ranks built different models (another seed per rank) still trains one model:
    # rank 0's weights are broadcast before sharding, so the 2-rank update equals the 1-process one
    common = MODEL + ["algorithm=gspo", "rollout.prompts_per_step=4", "rollout.group_size=4",
                      "algorithm.minibatches=1", "warmup.steps=0"]
    one = one_process(*common)
    torchrun(2, str(WORKER), str(tmp_path / "two.pt"), *common, f"train.data_parallel={mode}",
             "seed_per_rank=1")
    two = torch.load(tmp_path / "two.pt")
    for k, v in one["params"].items():
        torch.testing.assert_close(two["params"][k], v, rtol=0, atol=1e-5, msg=k)


@pytest.mark.parametrize("mode", ["fsdp", pytest.param("ddp", marks=pytest.mark.slow)])
def test_two_ranks_share_the_warm_up_and_give_the_single_process_result(tmp_path, one_process,
                                                                       mode):
    # each rank scores half of every warm-up batch; global token counts make the gradient the
    # whole batch's (answers differ in length, so a mean of per-rank means would not be)
    common = MODEL + ["warmup.steps=3", "warmup.batch_size=6", "rollout.prompts_per_step=2",
                      "rollout.group_size=2", "algorithm.minibatches=1", "warmup_only=1",
                      "algorithm.beta=0.1"]
    one = one_process(*common)
    torchrun(2, str(WORKER), str(tmp_path / "two.pt"), *common, f"train.data_parallel={mode}")
    two = torch.load(tmp_path / "two.pt")
    # the engine's copy (FSDP: its own) and pi_ref hold the warmed-up weights, not the initial
    assert one["copy_diffs"] == two["copy_diffs"] == {"engine": 0.0, "ref": 0.0}
    for k, g in one["grads"].items():  # the last warm-up step's gradient
        torch.testing.assert_close(two["grads"][k], g, rtol=1e-4, atol=1e-6, msg=k)
    # Adam's per-element normalisation amplifies float noise where a gradient is ~0
    for k, v in one["params"].items():
        torch.testing.assert_close(two["params"][k], v, rtol=0, atol=1e-4, msg=k)


@pytest.mark.parametrize("to", ["agent", "every process"])
def test_sigterm_under_torchrun_checkpoints_on_every_rank_and_says_how_to_resume(tmp_path, to):
    # a scheduler's preemption: SLURM signals every process of the job, Kubernetes the launcher
    # (torchrun forwards it to the ranks); either way all ranks stop after the same step
    from test_run_control import steps_logged, wait_for
    run = tmp_path / "run"
    args = MODEL + ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
                    "train.steps=100000", "train.eval_every=0", "train.save_every=0"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", "-m", "gspo", "train", "--output-dir", str(run),
                          *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**env, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        wait_for(lambda: steps_logged(run) >= 2, proc=p)
        os.killpg(p.pid, signal.SIGTERM) if to == "every process" else p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode != 0
    done = steps_logged(run)
    said = [line for line in err.splitlines() if line.startswith("gspo:")]
    assert said == [f"gspo: stopped by SIGTERM after {done} of 100000 RL steps; checkpoint "
                    f"{run / 'checkpoints' / f'step_{done:06d}'} holds it (every rank stopped "
                    f"cleanly: a SignalException traceback from torchrun after this line only "
                    f"reports the SIGTERM it got and passed on); continue with: gspo train "
                    f"--resume {run}"], err[-3000:]  # once, from rank 0
    # torchrun's traceback, which gspo cannot stop, comes after that line, as it says
    tail = err[err.index(said[0]):]
    assert "SignalException: Process" in tail and "SignalException" not in err[:err.index(said[0])]
    assert (run / "checkpoints" / f"step_{done:06d}" / "manifest.json").is_file()
    torchrun(2, "-m", "gspo", "train", "--resume", str(run), *args[:-3], f"train.steps={done + 1}",
             "train.eval_every=0")
    assert [r["step"] for r in read_metrics(run)] == list(range(1, done + 2))


# ---- the bad-input catalogue (tests/test_bad_inputs.py) under torchrun: every rank stops with
# the same whole `gspo: error:` line (torchrun's ChildFailedError report follows it: torchrun's
# design, see the README) and no traceback from gspo; the run is left as it was


def fails_cleanly_on_two_ranks(*args: str, says: str) -> None:
    out = launch(2, "-m", "gspo", "train", *args, "algorithm.minibatches=2",
                 "train.dist_timeout_s=60", timeout=150)
    assert out.returncode != 0
    said = [line for line in out.stderr.splitlines() if line.startswith("gspo")]
    assert said[-1] == "gspo FAILED", out.stderr[-3000:]  # torchrun's report comes last
    # each rank's line whole (torchrun may stop the slower rank before it gets there)
    assert set(said[:-1]) == {says} and len(said) <= 3, out.stderr[-3000:]
    # no frame in gspo's own modules (torchrun's frames, in a checkout that may itself be named
    # gspo/, are .../gspo/.venv/...: the package's files are gspo/x.py or gspo/engines/x.py)
    assert not re.search(r'File "[^"]*/gspo/(?:\w+/)?\w+\.py"', out.stderr), out.stderr[-3000:]


@pytest.mark.parametrize("damage", ["reward_mode",
                                    pytest.param("torn metrics line", marks=pytest.mark.slow)])
def test_a_refused_resume_under_torchrun(tmp_path, finished_run, damage):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    if damage == "reward_mode":
        args = ["data.reward_mode=fraction"]
        says = (f"gspo: error: --resume {run} cannot change data.reward_mode=fraction (trained "
                f"with all): start a new run with --output-dir for that")
    else:  # checked on every rank, though rank 0 alone writes metrics.jsonl
        _tear_a_middle_line(run / "metrics.jsonl")
        _without_metrics_copies(run)
        args = []
        says = (f"gspo: error: {run / 'metrics.jsonl'}:2: not a metrics row (a torn or edited "
                f"line), and the checkpoint of step 2 holds no copy of the file to restore it "
                f"from; delete or fix that line, then resume again")
    before = snapshot(run)
    fails_cleanly_on_two_ranks("--resume", str(run), "train.steps=3", *args, says=says)
    assert snapshot(run) == before


def test_fewer_held_out_rows_than_ranks_under_torchrun(tmp_path):
    rows = "".join(f'{{"prompt": "{i}+1?", "answer": "{i + 1}"}}\n' for i in range(4))
    (tmp_path / "rows.jsonl").write_text(rows)
    (tmp_path / "one.jsonl").write_text(rows.splitlines(keepends=True)[0])
    fails_cleanly_on_two_ranks(
        "--output-dir", str(tmp_path / "r"), *QUICK, "data.task=math",
        f"data.path={tmp_path / 'rows.jsonl'}", f"data.eval_path={tmp_path / 'one.jsonl'}",
        "train.eval_every=1", f"data.reward={USER}:constant",
        says="gspo: error: 1 held-out row(s) for 2 ranks: each rank evaluates its share; add "
             "held-out rows (data.n_eval, data.eval_path) or set train.eval_every=0")
    assert not (tmp_path / "r" / "checkpoints").exists()
