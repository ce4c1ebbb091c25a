import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gspo.models import (ModelLoadError, build_tiny_qwen3, build_tiny_qwen3_moe, build_tokenizer,
                         load_model)
from gspo.logprobs import logprobs_from_hidden, position_ids_from_mask, token_logprobs


# --- tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["3+4=7", "hello  world\n second line\n", " (a, b) -> {c}: 'x' \"y\" #_[]|\\?!\t"])
def test_tokenizer_round_trips_text_exactly(tok, text):
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, no bos added
    assert tok.decode(ids) == text


def test_tokenizer_special_tokens(tok):
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert tok.unk_token == "<unk>"
    ids = tok.encode("<|im_start|>ab<|im_end|>")
    assert ids == [tok.convert_tokens_to_ids("<|im_start|>"), tok.encode("a")[0], tok.encode("b")[0], tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "ab"
    assert tok.encode("é") == [tok.unk_token_id]


def test_chat_template_is_qwen_style(tok):
    msgs = [{"role": "user", "content": "3+4="}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3+4=<|im_end|>\n"


def test_tokenizer_save_and_reload_with_auto_tokenizer(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\nwhat is 12*3?<|im_end|>\n"
    assert reloaded.encode(text) == tok.encode(text)
    assert reloaded.decode(tok.encode(text)) == text
    assert (reloaded.pad_token_id, reloaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert reloaded.chat_template == tok.chat_template


# --- tiny models and loading -------------------------------------------------------------------


def test_tiny_qwen3_config(tok, model):
    cfg = model.config
    assert cfg.vocab_size == len(tok)
    assert (cfg.pad_token_id, cfg.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert cfg.head_dim == 16 and cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_tiny_qwen3_is_seeded_and_leaves_global_rng_alone(tok):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_qwen3(tok, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=1)
    assert torch.equal(torch.rand(1), before)
    b = build_tiny_qwen3(tok, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=1)
    c = build_tiny_qwen3(tok, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=2)
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_tiny_qwen3_moe_runs_and_every_layer_is_sparse(tok):
    moe = build_tiny_qwen3_moe(tok, hidden_size=32, num_heads=2, num_kv_heads=1, moe_intermediate_size=16)
    assert moe.config.num_experts == 8 and moe.config.num_experts_per_tok == 2
    assert all(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in moe.model.layers)
    ids = torch.tensor([tok.encode("1+2=3")])
    assert moe(ids).logits.shape == (1, 5, len(tok))


def test_load_model_round_trips_a_saved_tiny_model(tok, model, tmp_path):
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_model(str(tmp_path))
    ids = torch.tensor([tok.encode("12+30=42")])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert loaded_tok.encode("12+30=42") == ids[0].tolist()


def test_load_model_sets_missing_pad_token_to_eos(tok, model, tmp_path):
    model.save_pretrained(tmp_path)
    no_pad = build_tokenizer()
    no_pad.pad_token = None
    no_pad.save_pretrained(tmp_path)
    _, loaded_tok = load_model(str(tmp_path))
    assert loaded_tok.pad_token == loaded_tok.eos_token == "<|im_end|>"


def test_load_model_names_missing_path_and_fix(tmp_path):
    with pytest.raises(ModelLoadError, match="'./no/such/model' not found: pass a local directory"):
        load_model("./no/such/model")
    with pytest.raises(ModelLoadError, match=str(tmp_path)):  # exists, but holds no model
        load_model(str(tmp_path))
    assert issubclass(ModelLoadError, ValueError)


def test_a_weights_file_cut_short_is_a_model_load_error(tok, model, tmp_path):
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a killed copy
    with pytest.raises(ModelLoadError, match="could not load model .*incomplete metadata"):
        load_model(str(tmp_path))


def test_auto_model_reloads_the_saved_config_type(model, tmp_path):
    model.save_pretrained(tmp_path)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == "Qwen3ForCausalLM"


# --- per-token log-probs -----------------------------------------------------------------------


def _batch(tok, n_response=5):
    """Left-padded prompts of different lengths + right-padded responses of different lengths."""
    g = torch.Generator().manual_seed(0)
    B, Lp = 3, 7
    prompt = torch.randint(4, len(tok), (B, Lp), generator=g)  # (B, Lp)
    response = torch.randint(4, len(tok), (B, n_response), generator=g)  # (B, T)
    prompt_mask = torch.ones(B, Lp, dtype=torch.long)
    prompt_mask[0, :3] = 0
    prompt_mask[2, :1] = 0
    response_mask = torch.ones(B, n_response, dtype=torch.long)
    response_mask[1, 2:] = 0
    response_mask[2, 4:] = 0
    prompt[prompt_mask == 0] = tok.pad_token_id
    response[response_mask == 0] = tok.pad_token_id
    return torch.cat([prompt, response], 1), torch.cat([prompt_mask, response_mask], 1)


def _naive(model, ids, mask, n, temperature):
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    logp_all = torch.log_softmax(logits[:, -n - 1 : -1].float() / temperature, -1)  # (B, T, V)
    logp = logp_all.gather(-1, ids[:, -n:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def test_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy_equal_naive_log_softmax(tok, model, temperature):
    ids, mask = _batch(tok)
    with torch.no_grad():
        logp, entropy = token_logprobs(model, ids, mask, 5, temperature, chunk_size=4, with_entropy=True)
        naive_logp, naive_entropy = _naive(model, ids, mask, 5, temperature)
    assert logp.shape == entropy.shape == (3, 5)
    valid = mask[:, -5:].bool()
    torch.testing.assert_close(logp[valid], naive_logp[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[valid], naive_entropy[valid], atol=1e-5, rtol=0)


def test_token_logprobs_ignores_what_left_padding_holds(tok, model):
    ids, mask = _batch(tok)
    other = ids.clone()
    other[mask == 0] = 7  # garbage under the mask changes nothing real
    with torch.no_grad():
        a, b = token_logprobs(model, ids, mask, 5), token_logprobs(model, other, mask, 5)
    valid = mask[:, -5:].bool()
    torch.testing.assert_close(a[valid], b[valid], atol=1e-5, rtol=0)


def test_token_logprobs_chunk_size_does_not_change_result(tok, model):
    ids, mask = _batch(tok)
    with torch.no_grad():
        one, ent_one = token_logprobs(model, ids, mask, 5, 0.9, chunk_size=1, with_entropy=True)
        huge, ent_huge = token_logprobs(model, ids, mask, 5, 0.9, chunk_size=10**6, with_entropy=True)
    torch.testing.assert_close(one, huge, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent_one, ent_huge, atol=1e-6, rtol=0)


def test_token_logprobs_gradients_equal_naive_gradients(tok, model):
    ids, mask = _batch(tok)
    valid = mask[:, -5:].float()
    weights = torch.linspace(0.5, 1.5, 15).reshape(3, 5) * valid  # a masked, non-uniform loss

    def grads(fn):
        model.zero_grad()
        logp, entropy = fn()
        ((logp + 0.1 * entropy) * weights).sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    ours = grads(lambda: token_logprobs(model, ids, mask, 5, 0.8, chunk_size=3, with_entropy=True))
    naive = grads(lambda: _naive(model, ids, mask, 5, 0.8))
    model.zero_grad()
    for k in naive:
        torch.testing.assert_close(ours[k], naive[k], atol=1e-5, rtol=1e-4, msg=k)


def test_logprobs_from_hidden_with_bias_matches_dense_reference():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 8, generator=g)  # (B, T, H)
    weight, bias = torch.randn(11, 8, generator=g), torch.randn(11, generator=g)  # (V, H), (V,)
    targets = torch.randint(0, 11, (2, 3), generator=g)
    logp, entropy = logprobs_from_hidden(hidden, weight, targets, 2.0, chunk_size=2, bias=bias, with_entropy=True)
    ref = torch.log_softmax((hidden @ weight.T + bias) / 2.0, -1)  # (2, 3, 11)
    torch.testing.assert_close(logp, ref.gather(-1, targets[..., None]).squeeze(-1))
    torch.testing.assert_close(entropy, -(ref.exp() * ref).sum(-1))


# --- fast paths: the same function, less work ----------------------------------------------------


def _grouped_batch(tok, G=3, n_response=6):
    """Two prompts (left-padded, different lengths), G responses each of different lengths."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, len(tok), (5,), generator=g), torch.randint(4, len(tok), (3,), generator=g)]
    ids, mask = [], []
    for p in prompts:
        for j in range(G):
            n = n_response - j  # responses end at different lengths
            resp = torch.randint(4, len(tok), (n_response,), generator=g)
            resp[n:] = tok.pad_token_id
            row = torch.cat([torch.full((5 - len(p),), tok.pad_token_id), p, resp])
            ids.append(row)
            mask.append(torch.cat([torch.zeros(5 - len(p)), torch.ones(len(p)), torch.ones(n), torch.zeros(n_response - n)]))
    return torch.stack(ids), torch.stack(mask).long()


def _value_and_grads(model, ids, mask, n, **kw):
    model.zero_grad()
    logp, entropy = token_logprobs(model, ids, mask, n, 0.8, chunk_size=4, with_entropy=True, **kw)
    valid = mask[:, -n:].float()
    B, T = valid.shape
    weights = (0.5 + 0.1 * torch.arange(T)[None] + 0.2 * torch.arange(B)[:, None]) * valid
    ((logp + 0.1 * entropy) * weights).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    return logp.detach() * valid, entropy.detach() * valid, grads


def test_shared_prompt_forward_equals_one_plain_forward_in_values_and_gradients(tok, model):
    ids, mask = _grouped_batch(tok)
    shared = _value_and_grads(model, ids, mask, 6)
    plain = _value_and_grads(model, ids, mask, 6, share_prompts=False)
    torch.testing.assert_close(shared[0], plain[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared[1], plain[1], atol=1e-5, rtol=0)
    for k in plain[2]:
        torch.testing.assert_close(shared[2][k], plain[2][k], atol=1e-5, rtol=1e-4, msg=k)


def test_padding_columns_past_the_longest_response_change_nothing(tok, model):
    ids, mask = _grouped_batch(tok, n_response=4)
    pad = torch.full((ids.shape[0], 3), tok.pad_token_id)
    wide_ids, wide_mask = torch.cat([ids, pad], 1), torch.cat([mask, torch.zeros_like(pad)], 1)
    narrow = _value_and_grads(model, ids, mask, 4)
    wide = _value_and_grads(model, wide_ids, wide_mask, 7)
    torch.testing.assert_close(wide[0][:, :4], narrow[0], atol=1e-6, rtol=0)
    assert (wide[0][:, 4:] == 0).all() and (wide[1][:, 4:] == 0).all()
    for k in narrow[2]:
        torch.testing.assert_close(wide[2][k], narrow[2][k], atol=1e-6, rtol=1e-5, msg=k)


@pytest.mark.parametrize("others", [(0, 0), (2, 0), (0, 1), (3, 1), (5, 0), (9, 1)])
@pytest.mark.parametrize("distinct", [False, True])
def test_lockstep_paths_of_a_sharded_model_compute_the_same_function(tok, model, others, distinct):
    # under FSDP another rank may need more columns (others[0] more, even more than this rank's
    # 7 response columns) or cannot share prompts (others[1] = 1); all-distinct prompts then
    # still take the prompt-then-response path
    ids, mask = _grouped_batch(tok, G=1 if distinct else 3, n_response=4)
    pad = torch.full((ids.shape[0], 3), tok.pad_token_id)
    ids, mask = torch.cat([ids, pad], 1), torch.cat([mask, torch.zeros_like(pad)], 1)
    calls = []

    def sync_max(values):  # what the max over ranks would return
        calls.append(values)
        return [values[0] + others[0], max(values[1], others[1])]  # beyond 7: wider rollouts

    alone = _value_and_grads(model, ids, mask, 7, share_prompts=False)
    layer_calls = []
    hook = model.model.layers[0].register_forward_hook(lambda m, a, o: layer_calls.append(1))
    try:
        synced = _value_and_grads(model, ids, mask, 7, sync_max=sync_max)
    finally:
        hook.remove()
    assert calls and calls[0] == [4, 0]  # 4 real response columns; prompts can be shared
    # the same decoder calls whatever this rank's prompts: prompts then responses, or one pass
    assert len(layer_calls) == (1 if others[1] else 2)
    torch.testing.assert_close(synced[0], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(synced[1], alone[1], atol=1e-5, rtol=0)
    for k in alone[2]:
        torch.testing.assert_close(synced[2][k], alone[2][k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("with_entropy, entropy_weight", [(False, 0.0), (True, 0.0), (True, 0.3)])
def test_chunked_logprob_backward_equals_dense_autograd(with_entropy, entropy_weight):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)  # (B, T, H)
    weight = torch.randn(13, 8, generator=g, requires_grad=True)  # (V, H)
    bias = torch.randn(13, generator=g, requires_grad=True)
    targets = torch.randint(0, 13, (2, 5), generator=g)
    w_logp, w_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)

    def loss(logp, entropy=None):
        out = (logp * w_logp).sum()
        return out if entropy is None else out + entropy_weight * (entropy * w_ent).sum()

    def grads(value):
        return torch.autograd.grad(value, (hidden, weight, bias))

    out = logprobs_from_hidden(hidden, weight, targets, 1.7, chunk_size=3, bias=bias, with_entropy=with_entropy)
    ours = grads(loss(*out) if with_entropy else loss(out))
    ref_all = torch.log_softmax((hidden @ weight.T + bias) / 1.7, -1)  # (B, T, V)
    ref_logp = ref_all.gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = -(ref_all.exp() * ref_all).sum(-1)
    ref = grads(loss(ref_logp, ref_ent if with_entropy else None))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_sliding_window_model_without_layer_types_scores_through_one_plain_forward():
    # Mistral-7B-v0.1 sets sliding_window and no layer_types: transformers' cache for it keeps
    # only the window, so a group sharing its prompt must not run on that cache
    from transformers import MistralConfig, MistralForCausalLM
    config = MistralConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           sliding_window=4, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]] * 2)  # (B, L): one prompt, G = 2
    ids[1, 6:] = torch.tensor([20, 21, 22, 23])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logp = token_logprobs(model, ids, mask, 6)  # (B, 6)
        want = model(ids).logits.log_softmax(-1)[:, 3:-1].gather(-1, ids[:, 4:, None])[..., 0]
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-5)


def test_a_model_dir_without_tokenizer_files_is_a_clear_error(tmp_path, tok):
    from gspo.models import ModelLoadError, load_model
    build_tiny_qwen3(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=64).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="has no tokenizer files"):
        load_model(str(tmp_path))


def test_an_encoder_model_is_refused_naming_its_architecture(tmp_path):
    # it used to load as BertLMHeadModel with a warning and train on an [UNK]-only tokenizer
    from transformers import BertConfig, BertForMaskedLM

    from gspo.models import ModelLoadError, load_model
    BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="holds a BertForMaskedLM, not a causal"):
        load_model(str(tmp_path))


def test_the_logit_transforms_training_refuses_are_named_from_real_configs():
    """Gemma 2 soft-caps its logits, Cohere scales them, Granite and Falcon-H1 where set;
    Gemma 3 (no cap by default), Granite at 1.0, Qwen3 and Llama do nothing after the head."""
    import transformers as tf

    from gspo.logprobs import logit_transform
    assert logit_transform(tf.Gemma2Config()) == "final_logit_softcapping=30.0"
    assert logit_transform(tf.CohereConfig()) == "logit_scale=0.0625"
    assert logit_transform(tf.GraniteConfig(logits_scaling=8.0)) == "logits_scaling=8.0"
    assert logit_transform(tf.FalconH1Config(lm_head_multiplier=0.5)) == "lm_head_multiplier=0.5"
    for neutral in (tf.Gemma3TextConfig(), tf.GraniteConfig(), tf.Qwen3Config(), tf.LlamaConfig()):
        assert logit_transform(neutral) is None
