import pytest
import torch

from gspo import metrics as M
from gspo.models import build_tiny_qwen3_moe
from gspo.logprobs import token_logprobs
from gspo.moe import (MoeRouting, RoutingRecorder, expert_volatility, find_routers,
                      load_stats)


@pytest.fixture
def moe(tok):
    return build_tiny_qwen3_moe(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 90, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded prompt
    return ids, mask


class ChoiceSpy:
    """Captures the experts each router actually hands to its experts module."""

    def __init__(self, model):
        self.chosen = []
        self.handles = [m.register_forward_hook(lambda mod, a, out: self.chosen.append(out[2]))
                        for _, m in find_routers(model)]


def _record(model, rec, ids, mask, rows=None):
    rows = torch.arange(len(ids)) if rows is None else rows
    rec.allocate("old", len(ids), ids.shape[1] - 1)
    with torch.no_grad(), rec.record(rows):
        return token_logprobs(model, ids, mask, 5)


def test_replay_forces_the_recorded_experts_after_the_router_changed(moe, batch):
    ids, mask = batch
    rec = RoutingRecorder(moe)
    _record(moe, rec, ids, mask)
    with torch.no_grad():
        for _, router in find_routers(moe):
            router.weight.copy_(torch.randn_like(router.weight) * 5)  # a very different router
    spy = ChoiceSpy(moe)  # registered after the recorder: sees the replayed output
    free = ChoiceSpy(moe)
    with torch.no_grad():
        token_logprobs(moe, ids, mask, 5)  # free routing under the new router
    free_choice = [c.clone() for c in free.chosen]
    spy.chosen.clear()
    rows = torch.tensor([2, 0, 3, 1])  # a shuffled micro-batch, as the update pass uses
    with torch.no_grad(), rec.replay(rows):
        token_logprobs(moe, ids[rows], mask[rows], 5)
    for layer, chosen in enumerate(spy.chosen):
        recorded = rec.indices()[layer][rows].reshape(chosen.shape)
        assert torch.equal(chosen, recorded)
    # and the new router really would have chosen differently
    assert any(not torch.equal(f, rec.indices()[i].reshape(f.shape))
               for i, f in enumerate(free_choice))


def test_a_forward_cut_to_its_micro_batchs_longest_response_records_and_replays_its_prefix(
        moe, batch):
    # token_logprobs computes no column past the longest response of the rows it is given (a
    # fixed-size micro-batch without the batch's longest row, or a packed one): its positions
    # are a prefix of the recorded rows', which the record and the replay must line up
    ids, mask = batch
    mask = mask.clone()
    mask[:2, -3:] = 0  # rows 0 and 1: responses 2 tokens long, the others 5
    rows = torch.tensor([1, 0])
    rec = RoutingRecorder(moe)
    rec.allocate("old", len(ids), ids.shape[1] - 1)
    spy = ChoiceSpy(moe)
    with torch.no_grad(), rec.record(rows):
        token_logprobs(moe, ids[rows], mask[rows], 5)
    recorded = [c.clone() for c in spy.chosen]  # (2 x 8 positions, k) per router
    with torch.no_grad():
        for _, router in find_routers(moe):
            router.weight.copy_(torch.randn_like(router.weight) * 5)
    spy.chosen.clear()
    with torch.no_grad(), rec.replay(rows):
        token_logprobs(moe, ids[rows], mask[rows], 5)
    for layer, chosen in enumerate(spy.chosen):
        assert chosen.shape[0] == 2 * (ids.shape[1] - 1 - 3)
        assert torch.equal(chosen, recorded[layer])
        assert torch.equal(rec.indices()[layer][rows, :8].reshape(chosen.shape), chosen)


def test_routing_an_engine_reports_is_forced_in_pi_olds_recompute_and_the_update(moe, batch):
    """R3: experts the engine reports with its rollouts (vLLM's routed experts) become pi_old's
    routing, forced in the recompute (`recording`) and in every update forward (`replaying`)."""
    ids, mask = batch
    B, L = ids.shape
    g = torch.Generator().manual_seed(1)
    k = find_routers(moe)[0][1].top_k
    # k distinct experts per position, as a router picks them
    reported = [torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(B * (L - 1))])
                .view(B, L - 1, k) for _ in find_routers(moe)]
    routing = MoeRouting(moe, replay=True)
    routing.sampled(L - 1, reported)
    spy = ChoiceSpy(moe)
    rows = torch.tensor([3, 1])
    with torch.no_grad(), routing.recording(B, L - 1)(rows):  # pi_old's recompute
        token_logprobs(moe, ids[rows], mask[rows], 5)
    with torch.no_grad(), routing.replaying(rows):  # an update forward
        token_logprobs(moe, ids[rows], mask[rows], 5)
    n = len(find_routers(moe))
    for chosen in (spy.chosen[:n], spy.chosen[n:]):
        for layer, c in enumerate(chosen):
            assert torch.equal(c, reported[layer][rows].reshape(c.shape))
    with pytest.raises(RuntimeError, match="positions to replay"):
        routing.sampled(L, reported)  # a layout that does not fit the rollouts is refused
    routing.close()


def test_replay_without_a_weight_change_equals_free_routing(moe, batch):
    ids, mask = batch
    rec = RoutingRecorder(moe)
    free = _record(moe, rec, ids, mask)
    with torch.no_grad(), rec.replay(torch.arange(len(ids))):
        replayed = token_logprobs(moe, ids, mask, 5)
    torch.testing.assert_close(replayed, free, rtol=0, atol=1e-6)


def test_replayed_router_weights_still_get_gradients(moe, batch):
    ids, mask = batch
    rec = RoutingRecorder(moe)
    _record(moe, rec, ids, mask)
    with rec.replay(torch.arange(len(ids))):
        token_logprobs(moe, ids, mask, 5).sum().backward()
    for _, router in find_routers(moe):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_volatility_on_a_hand_built_case():
    # one layer, k=2, three counted tokens and one masked token:
    #   token 0: {1,2} -> {2,1}  no change            (kept 2/2)
    #   token 1: {0,3} -> {0,5}  one expert changed    (kept 1/2)
    #   token 2: {4,6} -> {5,7}  both changed          (kept 0/2)
    #   token 3: masked, its change must not count
    old = [torch.tensor([[[1, 2], [0, 3], [4, 6], [0, 1]]])]
    new = [torch.tensor([[[2, 1], [0, 5], [5, 7], [6, 7]]])]
    mask = torch.tensor([[1, 1, 1, 0]])
    out = expert_volatility(old, new, mask)
    assert out["volatility"] == pytest.approx(1 - (1 + 0.5 + 0) / 3)  # 0.5
    assert out["changed_frac"] == pytest.approx(2 / 3)
    # a second identical layer halves nothing: the mean over (token, layer) is the same
    assert expert_volatility(old * 2, new * 2, mask) == pytest.approx(out)


def test_load_stats_on_a_hand_built_case():
    # 4 experts, k=1, 4 tokens: experts 0,0,1,2 -> loads 1/2,1/4,1/4,0 -> x E = 2,1,1,0
    idx = [torch.tensor([[[0], [0], [1], [2]]])]
    out = load_stats(idx, torch.ones(1, 4), num_experts=4)
    assert out["load_max"] == pytest.approx(2.0) and out["load_min"] == 0.0
    frac = torch.tensor([0.5, 0.25, 0.25, 0.0])
    assert out["load_cv"] == pytest.approx(float(frac.std() / frac.mean()))


def test_router_hooks_leave_dense_models_untouched(model, batch):
    ids, mask = batch
    before = token_logprobs(model, ids, mask, 5)
    rec = RoutingRecorder(model)
    assert rec.routers == [] and rec._handles == []
    rec.allocate("old", len(ids), ids.shape[1] - 1)
    with rec.record(torch.arange(len(ids))):
        during = token_logprobs(model, ids, mask, 5)
    assert torch.equal(before, during)
    assert all(not m._forward_hooks for m in model.modules())


def test_routing_replay_in_train_logs_moe_metrics(tmp_path, tiny_overrides):
    from gspo.config import load_config
    from gspo.logger import read_metrics
    from gspo.trainer import train

    cfg = load_config(overrides=tiny_overrides + [
        "model.name_or_path=tiny-qwen3-moe", "model.moe_intermediate_size=32",
        "algorithm=grpo", "algorithm.routing_replay=true", "train.steps=1"])
    train(cfg, tmp_path / "run")
    row = read_metrics(tmp_path / "run")[-1]
    for key in (M.MOE + "volatility", M.MOE + "changed_frac", M.MOE + "load_max", M.MOE + "load_cv"):
        assert 0 <= row[key] < float("inf")


def test_moe_with_engine_logprobs_measures_volatility_on_the_recomputed_steps(
        tmp_path, tiny_overrides):
    """old_logprobs=rollout without Routing Replay: no training forward runs under pi_old, so
    the experts it chose are known only on the mismatch_every steps that recompute (this
    configuration used to stop with KeyError 'old')."""
    from gspo.config import load_config
    from gspo.logger import read_metrics
    from gspo.trainer import train

    cfg = load_config(overrides=tiny_overrides + [
        "model.name_or_path=tiny-qwen3-moe", "model.moe_intermediate_size=32",
        "algorithm.old_logprobs=rollout", "algorithm.mismatch_every=2", "train.steps=2"])
    train(cfg, tmp_path / "run")
    first, second = read_metrics(tmp_path / "run")[-2:]
    assert M.MOE + "volatility" in first and M.MISMATCH + "token_abs_max" in first  # step 0
    assert not any(k.startswith((M.MOE, M.MISMATCH)) for k in second)  # step 1: no recompute
    assert 0 <= first[M.MOE + "volatility"] <= 1


def test_routing_replay_on_a_dense_model_is_a_clear_error(tmp_path, tiny_overrides):
    from gspo.config import load_config
    from gspo.trainer import TrainingError, train

    cfg = load_config(overrides=tiny_overrides + ["algorithm.routing_replay=true"])
    with pytest.raises(TrainingError, match="Mixture-of-Experts"):
        train(cfg, tmp_path / "run")


@pytest.fixture
def grouped():
    """Two prompts of 2 rows each (the second left-padded), the responses differing: what
    token_logprobs shares a prompt's forward for."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, 90, (2, 7), generator=g)
    ids = torch.cat([prompts.repeat_interleave(2, 0), torch.randint(4, 90, (4, 5), generator=g)],
                    dim=1)  # (4, 12)
    mask = torch.ones_like(ids)
    mask[2:, :2] = 0
    mask[3, -2:] = 0  # a response shorter than the others
    return ids, mask


@pytest.mark.parametrize("share_prompts", [True, False])
def test_router_load_loss_is_transformers_aux_loss_in_value_and_gradient(moe, grouped,
                                                                         share_prompts):
    """RouterLoad over gspo's forward (a shared prompt's tokens counted once per row) equals
    the aux_loss transformers computes with output_router_logits over the same decoder
    positions (the last token, which predicts nothing, is not fed), and so do the routers'
    gradients."""
    from gspo.logprobs import position_ids_from_mask
    from gspo.moe import RouterLoad

    ids, mask = grouped
    ref = moe(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
              position_ids=position_ids_from_mask(mask[:, :-1]), output_router_logits=True)
    ref.aux_loss.backward()
    routers = [m.weight for _, m in find_routers(moe)]
    want = [w.grad.clone() for w in routers]
    moe.zero_grad()
    hooks = lambda: sum(len(m._forward_hooks) for m in moe.modules())  # noqa: E731
    before = hooks()  # transformers' own output recorders among them
    load = RouterLoad(moe)
    with load.collect():
        token_logprobs(moe, ids, mask, 5, share_prompts=share_prompts)
    aux = load.loss()
    aux.backward()
    assert float(aux.detach()) == pytest.approx(float(ref.aux_loss.detach()), rel=1e-5)
    assert float(aux.detach()) > 2.0  # above k = 2, its value at a perfectly even load
    for got, w in zip([w.grad for w in routers], want):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-7)
    load.close()
    assert hooks() == before


def test_router_aux_loss_follows_the_model_config_unless_set(moe, model):
    from gspo.moe import NoRouting, routing_for

    assert routing_for(moe, False).load is None  # output_router_logits off: no aux loss
    moe.config.output_router_logits, moe.config.router_aux_loss_coef = True, 0.02
    routing = routing_for(moe, False)
    assert routing.aux_coef == 0.02 and routing.load is not None
    routing.close()
    assert routing_for(moe, False, aux_coef=0.0).load is None  # set: the config's is overridden
    assert isinstance(routing_for(model, False), NoRouting)
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.1 needs a Mixture-of-Experts"):
        routing_for(model, False, aux_coef=0.1)


def test_router_aux_loss_in_train_is_logged_and_moves_the_routers(tmp_path, tiny_overrides):
    """The update adds coef * aux to its loss: the routers' weights after a step differ from a
    run without it (everything else equal), and moe/aux_loss is logged."""
    from transformers import AutoModelForCausalLM

    from gspo.checkpoint import latest_checkpoint
    from gspo.config import load_config
    from gspo.logger import read_metrics
    from gspo.trainer import train

    def run(name, coef):
        cfg = load_config(overrides=tiny_overrides + [
            "model.name_or_path=tiny-qwen3-moe", "model.moe_intermediate_size=32",
            f"algorithm.router_aux_loss_coef={coef}", "train.steps=1"])
        train(cfg, tmp_path / name)
        final = AutoModelForCausalLM.from_pretrained(latest_checkpoint(tmp_path / name))
        routers = {n: m.weight.detach() for n, m in find_routers(final)}
        return read_metrics(tmp_path / name)[-1], routers

    row, with_aux = run("aux", 1.0)
    plain_row, without = run("plain", 0)
    assert 2.0 <= row[M.MOE_AUX_LOSS] < 8.0  # k (even load) <= aux <= k * E / k (one expert)
    assert M.MOE_AUX_LOSS not in plain_row
    assert row[M.REWARD_MEAN] == plain_row[M.REWARD_MEAN]  # the same rollouts
    assert any(not torch.equal(with_aux[n], without[n]) for n in with_aux)


def test_routing_hooks_watch_the_model_only_while_recording_replaying_or_collecting(moe, batch):
    """A MoE model shared with the hf engine samples between the trainer's uses: hooks left
    on it would turn off the fast decoder's shared prefill and dropped rows (has_hooks)."""
    from gspo.engines.hf import has_hooks
    from gspo.moe import routing_for

    ids, mask = batch
    moe.config.output_router_logits, moe.config.router_aux_loss_coef = True, 0.01
    routing = routing_for(moe, replay=True)
    assert not has_hooks(moe)
    record = routing.recording(len(ids), ids.shape[1] - 1)
    with record(torch.arange(len(ids))):
        assert has_hooks(moe)
        token_logprobs(moe, ids, mask, 5)
    assert not has_hooks(moe)
    with routing.replaying(torch.arange(len(ids))), routing.balancing() as load:
        assert has_hooks(moe)
        token_logprobs(moe, ids, mask, 5)
    assert not has_hooks(moe) and float(load.loss().detach()) > 0
    routing.close()
    # what stays: transformers' own output capturing, installed by a forward asking for
    # router logits, which collects whatever rows a forward holds
    moe(input_ids=ids, output_router_logits=True)
    assert any(m._forward_hooks for m in moe.modules()) and not has_hooks(moe)
