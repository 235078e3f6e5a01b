"""AttnlabCache: transformers' cache appended in place (issue 49, item 5, the end-to-end part)."""

from __future__ import annotations

import pytest
import torch
import transformers  # the dev environment (make test) installs it: never skipped
from transformers import DynamicCache

import attnlab.integrations.transformers  # noqa: F401  registers "attnlab"
from attnlab.integrations.transformers_cache import MIN_CAPACITY, AttnlabCache, InPlaceLayer

V = 96


def tiny(family: str):
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=1024)
    cfg = (transformers.MistralConfig(num_key_value_heads=2, sliding_window=6, **common) if family == "mistral"
           else transformers.LlamaConfig(num_key_value_heads=2, **common))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def prompt(L: int = 40):
    ids = torch.randint(1, V, (2, L), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("impl", ["sdpa", "attnlab"])
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # the name 5.x-wide
def test_generate_with_the_in_place_cache_gives_the_same_tokens(family, impl):
    m = tiny(family)
    ids, mask = prompt()
    want = m.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    m.set_attn_implementation(impl)
    cache = AttnlabCache(m.config)
    got = m.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                     past_key_values=cache)
    assert torch.equal(got, want)
    full = [layer for layer in cache.layers if isinstance(layer, InPlaceLayer)]
    assert full if family == "llama" else len(full) == 0  # Mistral's layers all slide: transformers' own
    for layer in full:
        assert layer.keys.shape[-2] == 40 + 19 and layer.keys.data_ptr() == layer._buffers[0].data_ptr()


def test_a_step_writes_its_rows_into_the_buffer_and_returns_views():
    layer = InPlaceLayer()
    g = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 4, generator=g)
    k, v = layer.update(k0, v0)
    buffer = layer._buffers[0]
    assert buffer.shape == (1, 2, MIN_CAPACITY, 8) and k.data_ptr() == buffer.data_ptr()
    rows = [k0]
    for _ in range(3):
        k1, v1 = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 1, 4, generator=g)
        k, v = layer.update(k1, v1)
        rows.append(k1)
        assert layer._buffers[0] is buffer  # no new buffer: the step's row written in place
    assert torch.equal(k, torch.cat(rows, 2)) and layer.get_seq_length() == 8 and v.shape == (1, 2, 8, 4)


def test_the_buffer_doubles_when_full_and_keeps_what_it_held():
    layer = InPlaceLayer(capacity=4)
    ref = DynamicCache()
    g = torch.Generator().manual_seed(0)
    for n in (MIN_CAPACITY - 1, 1, 1, 3):
        k, v = torch.randn(1, 1, n, 4, generator=g), torch.randn(1, 1, n, 4, generator=g)
        got = layer.update(k, v)
        want = ref.update(k, v, 0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert layer._buffers[0].shape[2] == 2 * MIN_CAPACITY


def test_crop_and_reset_are_taken_over_at_the_next_update():
    layer = InPlaceLayer()
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 1, 10, 4, generator=g), torch.randn(1, 1, 10, 4, generator=g)
    layer.update(k, v)
    layer.crop(-4)  # transformers' own crop (4 tokens fewer) slices keys and values
    k1, v1 = torch.randn(1, 1, 1, 4, generator=g), torch.randn(1, 1, 1, 4, generator=g)
    got, _ = layer.update(k1, v1)
    assert torch.equal(got, torch.cat([k[:, :, :6], k1], 2))
    layer.reset()
    got, _ = layer.update(k1, v1)
    assert torch.equal(got, k1)


def test_the_generation_benchmark_times_each_cache_and_checks_the_tokens():
    from attnlab import bench

    rows = bench.generation_benchmark([32], new_tokens=3, layers=1, repeats=1)
    assert [(r["impl"], r["cache"]) for r in rows] == [("sdpa", "dynamic"), ("attnlab", "dynamic"),
                                                        ("attnlab", "in place")]
    assert all(r["same_tokens"] and r["token_ms"] > 0 for r in rows) and rows[0]["x_sdpa"] == 1.0
    assert "| 32 | attnlab | in place |" in bench.generation_table(rows)
