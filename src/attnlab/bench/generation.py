"""``attnlab bench --generate``: greedy generation with a Llama-shaped Hugging Face model, per new
token, sdpa against attnlab, with transformers' ``DynamicCache`` (``torch.cat`` each step) and with
attnlab's :class:`~attnlab.integrations.transformers_cache.AttnlabCache` (appended in place).

The model: randomly initialised, GQA 16 query heads on 4 key/value heads of 64 (hidden 1024),
``layers`` layers, vocabulary 1024. Each implementation prefills the same prompt, then takes
``new_tokens`` greedy steps, each timed; the implementations alternate round by round, and the
medians are reported with the ratio to sdpa's. The tokens must agree (a column says whether they do).
"""

from __future__ import annotations

import inspect
import statistics
import time
from typing import Callable, Optional

import torch

__all__ = ["GENERATE_LENS", "GENERATE_HEADER", "generation_benchmark", "generation_table"]

GENERATE_LENS = (1024, 4096)
IMPLS = (("sdpa", "dynamic"), ("attnlab", "dynamic"), ("attnlab", "in place"))
GENERATE_HEADER = ("greedy generation, Llama-shaped (GQA 16/4 heads of 64, hidden 1024), batch 1: prefill and the "
                   "median time per new token; cache 'dynamic' is transformers' DynamicCache (torch.cat each step), "
                   "'in place' attnlab's AttnlabCache; x sdpa: per-token time against sdpa with DynamicCache")


def _model(layers: int, max_len: int):
    import transformers

    import attnlab.integrations.transformers  # noqa: F401  registers "attnlab"

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                                   num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                   max_position_embeddings=max_len)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _generate(model, ids: torch.Tensor, cache, new_tokens: int) -> tuple[float, list[float], list[int]]:
    """Prefill seconds, each step's seconds, the tokens: greedy, one token a step."""
    # later transformers 5.x name the argument `cache` (and warn at `past_key_values`); earlier ones lack it
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, **{name: cache})
        prefill = time.perf_counter() - t0
        token = out.logits[:, -1:].argmax(-1)  # (1, 1)
        steps, tokens = [], [int(token)]
        for _ in range(new_tokens - 1):
            t0 = time.perf_counter()
            out = model(input_ids=token, use_cache=True, **{name: cache})
            token = out.logits[:, -1:].argmax(-1)
            steps.append(time.perf_counter() - t0)
            tokens.append(int(token))
    return prefill, steps, tokens


def generation_benchmark(prompt_lens=GENERATE_LENS, *, new_tokens: int = 32, layers: int = 4, repeats: int = 2,
                         progress: Optional[Callable[[int, int, str], None]] = None) -> list[dict]:
    """One row per (prompt length, implementation, cache): ``prefill_ms``, ``token_ms`` (median
    per new token over every round), ``x_sdpa`` and ``same_tokens`` (as sdpa's)."""
    from transformers import DynamicCache

    from attnlab.integrations.transformers_cache import AttnlabCache

    rows, done, total = [], 0, len(prompt_lens) * repeats * len(IMPLS)
    for L in prompt_lens:
        model = _model(layers, L + new_tokens)
        ids = torch.randint(0, 1024, (1, L), generator=torch.Generator().manual_seed(0))
        times: dict[tuple[str, str], tuple[list[float], list[float]]] = {k: ([], []) for k in IMPLS}
        tokens: dict[tuple[str, str], list[int]] = {}
        for _ in range(repeats):
            for impl, cache in IMPLS:
                model.set_attn_implementation(impl)
                kv = DynamicCache(config=model.config) if cache == "dynamic" else AttnlabCache(
                    model.config, capacity=L + new_tokens)
                prefill, steps, tokens[(impl, cache)] = _generate(model, ids, kv, new_tokens)
                times[(impl, cache)][0].append(prefill)
                times[(impl, cache)][1].extend(steps)
                done += 1
                if progress:
                    progress(done, total, f"generate L={L} {impl} {cache}")
        base = statistics.median(times[IMPLS[0]][1])
        for key in IMPLS:
            token_ms = statistics.median(times[key][1]) * 1e3
            rows.append({"L": L, "impl": key[0], "cache": key[1], "prefill_ms": min(times[key][0]) * 1e3,
                         "token_ms": token_ms, "x_sdpa": token_ms / (base * 1e3),
                         "same_tokens": tokens[key] == tokens[IMPLS[0]]})
    return rows


def generation_table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = ["| prompt | attention | cache | prefill ms | ms / token | x sdpa | same tokens |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['L']} | {r['impl']} | {r['cache']} | {r['prefill_ms']:.0f} | {r['token_ms']:.1f} | "
              f"{r['x_sdpa']:.2f} | {'yes' if r['same_tokens'] else 'NO'} |" for r in rows]
    return "\n".join(lines)
