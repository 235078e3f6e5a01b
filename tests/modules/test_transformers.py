"""attn_implementation="attnlab" in Hugging Face transformers (attnlab.integrations.transformers).

Tiny randomly initialised models of each family the integration must serve, one model per
test, its attention switched between "sdpa"/"eager" (the oracles) and "attnlab":
Llama (GQA), Mistral (sliding window), Qwen2 (one K/V head, sliding and full layers), Gemma 2
(tanh soft-capping, sliding window), GPT-2 (per-layer scaling, dropout in training) and BERT
(bidirectional, padding). Logits with right, left and no padding, parameter gradients, greedy
generate() with the KV cache. Each masked comparison is paired with a control showing that
the same comparison fails when the mask is dropped (the trap the mask hook exists for).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import transformers  # the dev environment (make test) installs it: never skipped

import attnlab.integrations.transformers as hf  # registers "attnlab"
from attnlab import flex
from attnlab.testing import assert_close, max_abs_diff

V, L = 96, 24
ORACLE = {"gemma2": "eager"}  # Gemma 2 refuses sdpa (soft-capping)


def config(family: str):
    common = dict(vocab_size=V, max_position_embeddings=256)
    decoder = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **common)
    if family == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, **decoder)
    if family == "mistral":
        return transformers.MistralConfig(num_key_value_heads=2, sliding_window=6, **decoder)
    if family == "qwen2":
        return transformers.Qwen2Config(num_key_value_heads=1, use_sliding_window=True, sliding_window=6,
                                        max_window_layers=1, layer_types=["sliding_attention", "full_attention"],
                                        **decoder)
    if family == "gemma2":
        return transformers.Gemma2Config(num_key_value_heads=2, head_dim=8, sliding_window=6,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                         query_pre_attn_scalar=8, **decoder)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, vocab_size=V,
                                       scale_attn_by_inverse_layer_idx=True, attn_pdrop=0.0, resid_pdrop=0.0,
                                       embd_pdrop=0.0)
    if family == "bert":
        return transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, initializer_range=0.2,
                                       **common)  # wider init: padding visibly changes the outputs
    raise ValueError(family)


def model(family: str, impl: str = None):
    impl = impl or ORACLE.get(family, "sdpa")
    torch.manual_seed(0)
    cls = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    return cls.from_config(config(family), attn_implementation=impl).eval()


def batch(padding: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (2, L), generator=g)
    mask = torch.ones(2, L, dtype=torch.long)
    if padding == "right":
        mask[1, L - 7:] = 0
    elif padding == "left":
        mask[1, :7] = 0
    return ids, mask


def logits_and_grads(m, impl: str, ids, mask):
    m.set_attn_implementation(impl)
    m.zero_grad()
    out = m(input_ids=ids, attention_mask=mask).logits
    labels = ids.masked_fill(mask == 0, -100)
    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return out.detach(), grads


CASES = [(f, p) for f in ("llama", "mistral", "qwen2", "gemma2", "gpt2", "bert") for p in ("none", "right", "left")
         if (f, p) != ("bert", "left")]  # BERT is right-padded in practice


@pytest.mark.parametrize("family,padding", CASES, ids=[f"{f}-{p}" for f, p in CASES])
def test_logits_and_parameter_gradients_match_the_oracle(family, padding):
    m = model(family)
    ids, mask = batch(padding)
    oracle = ORACLE.get(family, "sdpa")
    want, want_grads = logits_and_grads(m, oracle, ids, mask)
    got, got_grads = logits_and_grads(m, "attnlab", ids, mask)
    real = mask.bool()  # padded positions' outputs are not defined alike by every implementation
    assert_close(got[real], want[real], dtype=torch.float32, scope="model", msg=f"{family} logits")
    assert want_grads.keys() == got_grads.keys() and len(got_grads) > 4
    for name in want_grads:
        assert_close(got_grads[name], want_grads[name], dtype=torch.float32, scope="model", msg=f"{family} {name}")
    # the control, wherever the mask changes what real tokens see (sliding windows, left padding
    # under a causal mask, any padding when bidirectional; a causal model's right padding is
    # never seen by real tokens): the same comparison with the mask dropped is far outside it
    if family in ("mistral", "qwen2", "gemma2") or padding == "left" or (family == "bert" and padding != "none"):
        m.set_attn_implementation("attnlab")
        hf.AttentionMaskInterface.register("attnlab", lambda *a, **k: None)
        try:
            dropped = m(input_ids=ids, attention_mask=mask).logits.detach()
        finally:
            hf.register()
        assert max_abs_diff(dropped[real], want[real]) > 1e-2


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma2", "gpt2"])
def test_greedy_generation_with_the_kv_cache_gives_the_same_tokens(family):
    m = model(family)
    ids, mask = batch("left")
    oracle = ORACLE.get(family, "sdpa")
    m.set_attn_implementation(oracle)
    want = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    m.set_attn_implementation("attnlab")
    got = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert got.shape == (2, L + 12)
    assert torch.equal(got, want)


def test_a_sliding_window_longer_than_a_block_is_a_block_mask_not_a_dense_one(monkeypatch):
    """Mistral at L = 300 with a window of 64: the mask hook builds an attnlab.flex BlockMask
    (blocks of 128, most of them empty) and the logits still match sdpa's."""
    cfg = config("mistral")
    cfg.sliding_window = 64
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(3, V, (1, 300), generator=torch.Generator().manual_seed(2))
    want = m(input_ids=ids).logits
    made = []
    real = hf.attnlab_mask

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    hf.AttentionMaskInterface.register("attnlab", spy)
    try:
        m.set_attn_implementation("attnlab")
        got = m(input_ids=ids).logits
    finally:
        hf.register()
    block_masks = [b for b in made if isinstance(b, flex.BlockMask)]
    assert block_masks and block_masks[0].BLOCK_SIZE == (128, 128)
    assert block_masks[0].counts()["empty"] > 0
    assert_close(got, want, dtype=torch.float32, scope="model")


def test_output_attentions_returns_the_eager_weights():
    m = model("llama")
    ids, mask = batch("right")
    m.set_attn_implementation("eager")
    want = m(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    m.set_attn_implementation("attnlab")
    got = m(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    real = mask.bool()
    for a, b in zip(got, want):
        assert a.shape == (2, 4, L, L)
        # (B, H, L, S) -> (B, L, H, S): the rows of real queries
        assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], dtype=torch.float32, scope="model")


def test_gpt2_trains_with_attention_dropout():
    """Training mode with attn_pdrop > 0 runs (the tiled path has no dropout: the reference
    takes those calls), changes with the seed, and is unbiased: averaged over many draws the
    attention output tends to the no-dropout one."""
    cfg = config("gpt2")
    cfg.attn_pdrop = 0.3
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="attnlab").train()
    ids, mask = batch("right")
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        out = m(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
        outs.append(out.logits.detach())
        assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    assert max_abs_diff(outs[0], outs[1]) > 1e-3  # dropout is on

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    layer = m.transformer.h[0].attn
    plain, _ = hf.attnlab_attention_forward(layer, q, k, v, None, dropout=0.0)
    torch.manual_seed(4)
    n = 4000
    mean = sum(hf.attnlab_attention_forward(layer, q, k, v, None, dropout=0.3)[0] for _ in range(n)) / n
    # each output is a sum of 16 values weighted by dropped-out weights: the mean's error is
    # ~ sd / sqrt(n); 5 standard errors of the largest output sd (~1.5 here) bound it
    assert max_abs_diff(mean, plain) < 5 * 1.5 / n ** 0.5


def test_an_unsupported_transformers_version_is_refused_with_the_range():
    for version in ("4.57.1", "6.0.0"):
        with pytest.raises(ImportError, match=rf"transformers >=5\.0,<6, found {version}: pip install 'attnlab\[hf\]'"):
            hf.check_version(version)
    hf.check_version("5.24.0")
    hf.check_version()  # the installed one, as the import did


def test_a_position_bias_is_refused_with_what_to_use():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="attn_implementation='eager'"):
        hf.attnlab_attention_forward(torch.nn.Module(), q, q, q, None, position_bias=torch.zeros(1, 2, 4, 4))


def test_softcap_with_a_caller_mask_matches_the_formula_or_is_refused():
    """Soft-capping with a dense mask the caller made (not from the mask hook): a bool or
    0/min float mask becomes a BlockMask; an additive bias is refused, never dropped."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) * 3 for _ in range(3))
    keep = torch.rand(2, 1, 9, 9, generator=g) > 0.3
    keep[..., 0] = True
    layer = torch.nn.Module()
    out, _ = hf.attnlab_attention_forward(layer, q, k, v, keep, softcap=2.0, is_causal=False)
    s = q.double() @ k.double().transpose(-2, -1) / 8 ** 0.5
    s = (2.0 * torch.tanh(s / 2.0)).masked_fill(~keep, float("-inf"))
    want = (torch.softmax(s, dim=-1) @ v.double()).transpose(1, 2)  # the oracle, in the test only
    assert_close(out, want.float(), dtype=torch.float32)
    as_float = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    out_float, _ = hf.attnlab_attention_forward(layer, q, k, v, as_float, softcap=2.0, is_causal=False)
    assert_close(out_float, want.float(), dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="additive float attention mask"):
        hf.attnlab_attention_forward(layer, q, k, v, as_float + 0.5, softcap=2.0, is_causal=False)


def _gpt_oss(attn: str, seed: int = 0):
    cfg = transformers.GptOssConfig(vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                    num_experts_per_tok=1, sliding_window=6, max_position_embeddings=64)
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)  # float32: the experts'
    with torch.no_grad():  # grouped GEMM takes no float64. Sinks of either sign that matter (the init: near 0)
        for layer in m.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 3.0]))
    return m


def test_gpt_oss_through_attnlab_equals_eager_logits_gradients_and_generation():
    """Issue 50: a tiny GptOssForCausalLM ran with s_aux dropped, its logits 45% off eager's and its
    sinks without a gradient. Now s_aux is attnlab's sinks: logits, the gradient of every parameter
    (the sinks included) and greedy generation equal eager's, with the sliding-window layers (flex)
    and the full ones, a padded batch included. (With the sinks dropped again the logits differ by
    far more than the bound, and the sinks' gradients are None.)"""
    eager, ours = _gpt_oss("eager"), _gpt_oss("attnlab")
    ours.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, 12), generator=g)
    pad = torch.ones(2, 12, dtype=torch.long)
    pad[1, :3] = 0  # the second sequence left-padded
    for mask in (None, pad):
        outs = []
        for m in (eager, ours):
            m.zero_grad()
            logits = m(ids, attention_mask=mask).logits
            real = logits if mask is None else logits[mask.bool()]  # eager's padded rows are not defined
            (real * torch.randn(real.shape, generator=torch.Generator().manual_seed(1), dtype=real.dtype)).sum().backward()
            outs.append((real.detach(), {n: p.grad for n, p in m.named_parameters()}))
        (want, want_grads), (got, got_grads) = outs
        assert_close(got, want, dtype=torch.float32, scope="model", msg="gpt-oss logits")
        assert set(got_grads) == set(want_grads)
        for name, grad in want_grads.items():
            if grad is None:
                assert got_grads[name] is None, name
                continue
            assert got_grads[name] is not None, name
            assert_close(got_grads[name], grad, dtype=torch.float32, scope="model", msg=f"gpt-oss {name}")
        sinks = [n for n in want_grads if n.endswith("sinks")]
        assert len(sinks) == 2 and all(want_grads[n].abs().max() > 1e-3 for n in sinks)  # gradients that matter
    with torch.no_grad():
        prompt = ids[:1, :5]
        a = eager.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        b = ours.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("name", ["position_bias", "block_indices", "a_new_option"])
def test_an_argument_attnlab_does_not_implement_is_refused_by_name(name):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match=f"'{name}'.*attn_implementation='eager'"):
        hf.attnlab_attention_forward(torch.nn.Module(), q, q, q, None, **{name: torch.zeros(2)})
    out, _ = hf.attnlab_attention_forward(torch.nn.Module(), q, q, q, None, **{name: None})  # absent: fine
    assert out.shape == (1, 4, 2, 8)


def test_the_arguments_transformers_passes_are_each_implemented_refused_or_in_the_mask():
    """Every keyword transformers' models pass to an attention function (read from their source)
    is in ACCEPTED_KWARGS or REFUSED_KWARGS: a new one fails here instead of being dropped."""
    import glob
    import re

    root = Path(transformers.__file__).parent / "models"
    passed = set()
    for path in glob.glob(str(root / "*" / "modeling_*.py")):
        for call in re.finditer(r"attention_interface\((.*?)\n\s*\)", Path(path).read_text(), re.S):
            passed.update(re.findall(r"\n\s*([a-z_]+)=", call.group(1)))
    named = {"attention_mask", "dropout", "scaling", "is_causal", "query", "key", "value"}  # the signature's own
    assert {"s_aux", "sliding_window", "softcap"} <= passed, passed  # the read found the calls
    unknown = passed - named - hf.ACCEPTED_KWARGS - set(hf.REFUSED_KWARGS)
    assert unknown <= {"indices", "block_indices"}, unknown  # FlashAttention-only internals, refused if given


# what each accepted argument does when transformers passes it (a value of the kind it passes)
_FED = {"softcap": 2.0, "output_attentions": True, "s_aux": torch.tensor([1.0, -2.0]),
        "sinks": torch.tensor([1.0, -2.0]), "sliding_window": 3, "position_ids": torch.arange(4)[None],
        "cu_seq_lens_q": torch.tensor([0, 4], dtype=torch.int32), "cu_seq_lens_k": torch.tensor([0, 4], dtype=torch.int32),
        "max_length_q": 4, "max_length_k": 4, "num_items_in_batch": 7, "output_hidden_states": True,
        "output_router_logits": True, "use_cache": True, "cache_position": torch.arange(4), "past_key_values": object(),
        "past_key_value": object(), "return_dict": True, "deterministic": True}
# the ones that change the attention itself; every other accepted one is in the mask already or not about it
_CHANGES = {"softcap", "s_aux", "sinks"}


@pytest.mark.parametrize("name", sorted(hf.ACCEPTED_KWARGS))
def test_every_accepted_argument_fed_as_transformers_passes_it(name):
    """Each argument attnlab accepts, fed with a value of the kind transformers passes: those that
    change attention (soft cap, sinks) change the output by their formula; output_attentions returns
    the weights; every other one leaves the output exactly as without it (in the mask already, or
    not about attention), never an error."""
    assert name in _FED, f"{name}: add a value of the kind transformers passes to _FED"
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    layer = torch.nn.Module()
    plain, _ = hf.attnlab_attention_forward(layer, q, k, v, None, is_causal=True)
    out, weights = hf.attnlab_attention_forward(layer, q, k, v, None, is_causal=True, **{name: _FED[name]})
    s = q.double() @ k.double().transpose(-2, -1) / 8 ** 0.5
    if name == "softcap":
        s = 2.0 * torch.tanh(s / 2.0)
    s = s.masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    if name in ("s_aux", "sinks"):
        s = torch.cat([s, _FED[name].double()[None, :, None, None].expand(1, 2, 4, 1)], -1)
    p = torch.softmax(s, -1)[..., :4]  # the oracle, in the test only
    assert_close(out, (p @ v.double()).transpose(1, 2).float(), dtype=torch.float32, msg=name)
    if name not in _CHANGES:
        assert torch.equal(out, plain), name
    assert (weights is not None) == (name == "output_attentions")
