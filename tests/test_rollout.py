import copy

import pytest
import torch

from gspo.models import build_tiny_qwen3, build_tiny_qwen3_moe
from gspo.logprobs import token_logprobs
from gspo.engines.fast_decoder import FastDecoder
from gspo.engines.hf import HFEngine, sample_next, top_p_filter
from gspo.engines import Rollouts, SamplingParams, left_pad


@pytest.fixture(scope="module")
def prompts(tok):
    # Different lengths, so the batch is left-padded.
    return [tok.encode("12+7="), tok.encode("<|im_start|>user\nhi<|im_end|>\n"), tok.encode("x")]


def with_eos_bias(model, eos_id: int, bias: float):
    """A copy of model whose lm_head adds `bias` to the eos logit (untied head with a bias)."""
    biased = copy.deepcopy(model)
    weight = biased.model.embed_tokens.weight
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=True)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.zero_()
        head.bias[eos_id] = bias
    biased.lm_head = head
    return biased


def recompute(model, r: Rollouts, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model, r.input_ids, r.attention_mask, r.response_ids.shape[1], temperature)


# --- helpers -----------------------------------------------------------------------------------


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    # cumulative mass before each token: 0, 0.5, 0.8
    assert torch.isfinite(top_p_filter(logits, 0.6)).tolist() == [[True, True, False]]
    assert torch.isfinite(top_p_filter(logits, 0.4)).tolist() == [[True, False, False]]
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_sampling_params_are_validated():
    for bad in [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(max_new_tokens=0)]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# --- HFEngine ----------------------------------------------------------------------------------


def test_shapes_and_prompt_major_layout(tok, model, prompts):
    r = HFEngine(model).generate(prompts, n=2, params=SamplingParams(max_new_tokens=6), seed=0)
    B, Lp = 6, max(len(p) for p in prompts)
    assert r.prompt_ids.shape == r.prompt_mask.shape == (B, Lp)
    assert r.response_ids.shape == r.response_mask.shape == r.logp.shape
    assert r.response_ids.shape[0] == B and r.response_ids.shape[1] <= 6
    assert r.input_ids.shape == r.attention_mask.shape == (B, Lp + r.response_ids.shape[1])
    assert r.response_mask.dtype == torch.float32 and r.response_lengths.dtype == torch.long
    for row in range(B):  # rows [p0s0, p0s1, p1s0, p1s1, p2s0, p2s1]
        p = prompts[row // 2]
        assert r.prompt_ids[row, Lp - len(p) :].tolist() == p
        assert (r.prompt_ids[row, : Lp - len(p)] == tok.pad_token_id).all()
        assert r.prompt_mask[row].sum() == len(p)


def test_same_seed_same_rollouts_other_seed_differs(model, prompts):
    engine, params = HFEngine(model), SamplingParams(temperature=1.0, max_new_tokens=8)
    a, b = engine.generate(prompts, 2, params, seed=3), engine.generate(prompts, 2, params, seed=3)
    c = engine.generate(prompts, 2, params, seed=4)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logp, b.logp)
    assert not torch.equal(a.response_ids, c.response_ids)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9)])
def test_sampler_logp_equals_recomputed_token_logprobs(model, prompts, temperature, top_p):
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=10)
    r = HFEngine(model).generate(prompts, 2, params, seed=0)
    mask = r.response_mask.bool()
    torch.testing.assert_close(r.logp[mask], recompute(model, r, temperature)[mask], atol=1e-4, rtol=0)
    assert (r.logp[~mask] == 0).all()


def test_moe_sampler_logp_equals_recomputed_token_logprobs(tok, prompts):
    moe = build_tiny_qwen3_moe(tok, hidden_size=32, num_heads=2, num_kv_heads=1, moe_intermediate_size=16)
    r = HFEngine(moe).generate(prompts, 2, SamplingParams(temperature=0.9, max_new_tokens=6), seed=0)
    mask = r.response_mask.bool()
    torch.testing.assert_close(r.logp[mask], recompute(moe, r, 0.9)[mask], atol=1e-4, rtol=0)


def test_mask_stops_after_eos_and_padding_holds_pad_id(tok, model, prompts):
    eos, pad = tok.eos_token_id, tok.pad_token_id
    biased = with_eos_bias(model, eos, bias=1.5)  # eos likely, but not certain, at each step
    r = HFEngine(biased).generate(prompts, 4, SamplingParams(max_new_tokens=12), seed=0)
    lengths = r.response_lengths.tolist()
    assert min(lengths) < max(lengths)  # rows stop at different steps
    for row, n in enumerate(lengths):
        ids = r.response_ids[row].tolist()
        assert r.response_mask[row].tolist() == [1.0] * n + [0.0] * (len(ids) - n)
        assert eos not in ids[: n - 1]
        if n < len(ids) or ids[n - 1] == eos:  # finished: eos is the last real token
            assert ids[n - 1] == eos and ids[n:] == [pad] * (len(ids) - n)
    mask = r.response_mask.bool()
    torch.testing.assert_close(r.logp[mask], recompute(biased, r, 1.0)[mask], atol=1e-4, rtol=0)


def test_loop_ends_when_all_rows_finished(tok, model, prompts):
    certain_eos = with_eos_bias(model, tok.eos_token_id, bias=100.0)
    r = HFEngine(certain_eos).generate(prompts, 2, SamplingParams(max_new_tokens=8), seed=0)
    assert r.response_ids.shape[1] == 1 and (r.response_ids == tok.eos_token_id).all()
    assert (r.response_lengths == 1).all()


def test_max_new_tokens_respected(tok, model, prompts):
    no_eos = with_eos_bias(model, tok.eos_token_id, bias=-100.0)
    r = HFEngine(no_eos).generate(prompts, 2, SamplingParams(max_new_tokens=5), seed=0)
    assert r.response_ids.shape[1] == 5 and (r.response_lengths == 5).all()


def test_greedy_equals_transformers_generate_and_full_forward_argmax(tok, model, prompts):
    r = HFEngine(model).generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=10), seed=0)
    out = model.generate(
        input_ids=r.prompt_ids,
        attention_mask=r.prompt_mask,
        do_sample=False,
        max_new_tokens=10,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    assert torch.equal(out[:, r.prompt_ids.shape[1] :], r.response_ids)
    # No cache: each greedy token is the argmax of a full forward over the final sequence.
    T = r.response_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=r.input_ids, attention_mask=r.attention_mask).logits[:, -T - 1 : -1]
    mask = r.response_mask.bool()
    assert torch.equal(logits.argmax(-1)[mask], r.response_ids[mask])
    torch.testing.assert_close(r.logp[mask], recompute(model, r, 1.0)[mask], atol=1e-4, rtol=0)


def test_tiny_top_p_behaves_as_greedy(model, prompts):
    engine = HFEngine(model)
    greedy = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=8), seed=0)
    nucleus = engine.generate(prompts, 2, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=8), seed=5)
    assert torch.equal(nucleus.response_ids[::2], greedy.response_ids)
    assert torch.equal(nucleus.response_ids[1::2], greedy.response_ids)


def test_generate_restores_train_mode_and_returns_trainable_tensors(model, prompts):
    engine = HFEngine(model)
    model.train()
    r = engine.generate(prompts, 1, SamplingParams(max_new_tokens=4), seed=0)
    assert model.training
    # The rollout tensors can enter the training graph (no inference-mode tensors leak out).
    logp = token_logprobs(model, r.input_ids, r.attention_mask, r.response_ids.shape[1])
    ((logp - r.logp) * r.response_mask).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    model.zero_grad()
    model.eval()
    engine.generate(prompts, 1, SamplingParams(max_new_tokens=2), seed=0)
    assert not model.training


def test_load_weights_is_noop_for_own_weights_and_copies_others(tok, model, prompts):
    engine = HFEngine(copy.deepcopy(model))
    before = engine.model.model.embed_tokens.weight.data_ptr()
    engine.load_weights(engine.model.state_dict().items())
    assert engine.model.model.embed_tokens.weight.data_ptr() == before

    other = build_tiny_qwen3(tok, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=9)
    engine.load_weights(iter(other.state_dict().items()))  # one pass over an iterator
    params = SamplingParams(max_new_tokens=6)
    expected = HFEngine(other).generate(prompts, 2, params, seed=1).response_ids
    assert torch.equal(engine.generate(prompts, 2, params, seed=1).response_ids, expected)


def test_load_weights_rejects_unknown_and_missing_tensors(tok, model):
    engine = HFEngine(copy.deepcopy(model))
    weights = dict(model.state_dict())
    with pytest.raises(KeyError, match="'extra.weight' is not a weight"):
        engine.load_weights([*weights.items(), ("extra.weight", torch.zeros(1))])
    weights.pop("model.norm.weight")
    with pytest.raises(KeyError, match="model.norm.weight"):
        engine.load_weights(weights.items())
    tied = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    engine.load_weights(tied.items())  # a tied alias needs no tensor of its own
    tied["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights(tied.items())


# --- the fast path: same rollouts as the plain loop ----------------------------------------------


def _tiny_llama_family(tok, kind):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common)).eval()  # q/k/v with biases


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "llama", "qwen2"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.8, 0.9), (0.0, 1.0)])
def test_fast_decode_equals_plain_loop(tok, model, prompts, arch, temperature, top_p):
    if arch == "qwen3":
        m = model
    elif arch == "qwen3_moe":
        m = build_tiny_qwen3_moe(tok, hidden_size=32, num_heads=2, num_kv_heads=1, moe_intermediate_size=16)
    else:
        m = _tiny_llama_family(tok, arch)
    # eos made likely, so rows stop at different steps and the fast path drops finished rows
    m = with_eos_bias(m, tok.eos_token_id, bias=2.0)
    assert FastDecoder.supports(m)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12)
    fast = HFEngine(m, eos_token_ids=[tok.eos_token_id]).generate(prompts, 4, params, seed=3)
    plain = HFEngine(m, eos_token_ids=[tok.eos_token_id], fast=False).generate(prompts, 4, params, seed=3)
    assert torch.equal(fast.response_ids, plain.response_ids)
    assert torch.equal(fast.response_mask, plain.response_mask)
    torch.testing.assert_close(fast.logp, plain.logp, atol=1e-5, rtol=0)
    if temperature > 0:
        assert 1 < len(set(fast.response_lengths.tolist()))


def test_fast_decode_keeps_every_row_in_every_forward_when_hooks_watch(tok, model, prompts):
    seen = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda mod, a, out: seen.append(a[0].shape[0]))
    try:
        r = HFEngine(model).generate(prompts, 3, SamplingParams(max_new_tokens=5), seed=0)
    finally:
        handle.remove()
    B = len(prompts) * 3
    assert seen and all(n == B for n in seen)  # no shared prefill, no dropped rows
    plain = HFEngine(model, fast=False).generate(prompts, 3, SamplingParams(max_new_tokens=5), seed=0)
    assert torch.equal(r.response_ids, plain.response_ids)


def test_sampler_draws_from_the_softmax_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(20000, 4)  # (B, V)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    token, logp = sample_next(logits, SamplingParams(temperature=1.0), u)
    freq = torch.bincount(token, minlength=4).float() / len(token)
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.01, rtol=0)
    torch.testing.assert_close(logp, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1))


def test_vllm_routing_lands_on_the_trainers_decoder_positions():
    """vLLM reports each row's routing over its unpadded prompt + response; the trainer's
    forward reads Lp + T - 1 left-padded decoder inputs. Hand-built: Lp = 3, T = 2, 2 layers,
    k = 1, row 0 with a 3-token prompt, row 1 with a 1-token prompt; expert id = 10 * layer +
    position in the sequence (+ 100 for row 1)."""
    import numpy as np

    from gspo.engines.vllm import routing_tensors
    row0 = np.array([[[p], [10 + p]] for p in range(5)])  # 3 prompt + 2 response tokens
    row1 = np.array([[[100 + p], [110 + p]] for p in range(2)])  # 1 prompt + 1 sampled token
    layer0, layer1 = routing_tensors([row0, row1], [3, 1], Lp=3, T=2)
    # row 0: no padding; 4 decoder inputs, the last sampled token's routing is never read
    assert layer0[0, :, 0].tolist() == [0, 1, 2, 3]
    assert layer1[0, :, 0].tolist() == [10, 11, 12, 13]
    # row 1: two pad columns (expert 0), then its prompt token and its one response token
    assert layer0[1, :, 0].tolist() == [0, 0, 100, 101]
    assert layer1[1, :, 0].tolist() == [0, 0, 110, 111]


# --- Rollouts.select / Rollouts.cat: rounds of other widths joined (rollout.filter_groups) ------


def test_cat_pads_each_part_to_the_widest_and_keeps_every_row(model, tok, prompts):
    engine = HFEngine(model, pad_token_id=tok.pad_token_id)
    short = engine.generate([prompts[2]], n=2, params=SamplingParams(1.0, 1.0, 2), seed=0)
    long = engine.generate(prompts[:2], n=2, params=SamplingParams(1.0, 1.0, 6), seed=1)
    assert short.prompt_ids.shape[1] < long.prompt_ids.shape[1]
    both = Rollouts.cat([short, long], pad_id=tok.pad_token_id)
    B, Lp, T = 6, long.prompt_ids.shape[1], max(short.response_ids.shape[1],
                                                long.response_ids.shape[1])
    assert both.prompt_ids.shape == (B, Lp) and both.response_ids.shape == (B, T)
    for part, rows in ((short, range(0, 2)), (long, range(2, 6))):
        for i, row in enumerate(rows):  # the real tokens, unchanged and in place
            p, r = part.prompt_mask[i].bool(), part.response_mask[i].bool()
            assert torch.equal(both.prompt_ids[row][both.prompt_mask[row].bool()],
                               part.prompt_ids[i][p])
            assert torch.equal(both.response_ids[row][both.response_mask[row].bool()],
                               part.response_ids[i][r])
            assert torch.equal(both.logp[row][both.response_mask[row].bool()], part.logp[i][r])
    # the new padding: pad ids under mask 0, log-prob 0
    assert (both.prompt_ids[:2, :Lp - short.prompt_ids.shape[1]] == tok.pad_token_id).all()
    assert both.prompt_mask[:2, :Lp - short.prompt_ids.shape[1]].sum() == 0
    assert both.logp[both.response_mask == 0].abs().sum() == 0
    # padding changes nothing: the policy's log-probs of each part, in the joined batch
    joined = recompute(model, both, 1.0)
    for part, rows in ((short, slice(0, 2)), (long, slice(2, 6))):
        alone = recompute(model, part, 1.0)
        got = joined[rows, :alone.shape[1]] * part.response_mask
        torch.testing.assert_close(got, alone * part.response_mask, rtol=1e-5, atol=1e-5)


def test_select_and_cat_carry_moe_routing_position_for_position():
    # 2 rows of prompt 2 + response 3 (4 decoder positions) and 1 row of prompt 3 + response 1
    # (3 positions); joined at prompt 3 + response 3: 5 positions, the first part's shifted
    # right by one (its prompt is padded on the left), the second's padded on the right
    def part(B, Lp, T, first):
        ids = torch.arange(B * Lp).view(B, Lp) + 1
        route = torch.arange(first, first + B * (Lp + T - 1)).view(B, Lp + T - 1, 1)
        return Rollouts(ids, torch.ones(B, Lp, dtype=torch.long),
                        torch.full((B, T), 9), torch.ones(B, T), torch.full((B, T), -1.0),
                        routing=[route, route + 1000])
    a, b = part(2, 2, 3, 100), part(1, 3, 1, 200)
    both = Rollouts.cat([a, b], pad_id=0)
    assert [x.shape for x in both.routing] == [(3, 5, 1)] * 2
    assert both.routing[0][:, :, 0].tolist() == [[0, 100, 101, 102, 103],
                                                 [0, 104, 105, 106, 107],
                                                 [200, 201, 202, 0, 0]]
    assert torch.equal(both.routing[1][2, :3], b.routing[1][0])
    assert both.input_ids.shape[1] - 1 == both.routing[0].shape[1]
    picked = both.select(torch.tensor([2, 0]))
    assert picked.routing[0][:, :, 0].tolist() == [[200, 201, 202, 0, 0], [0, 100, 101, 102, 103]]
    assert torch.equal(picked.prompt_ids, both.prompt_ids[[2, 0]])
    with pytest.raises(ValueError, match="some parts carry MoE routing"):
        Rollouts.cat([a, Rollouts(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask,
                                  b.logp)], pad_id=0)
