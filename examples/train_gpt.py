"""Train a small GPT on the CPU with attnlab's attention (or torch SDPA, to compare).

    python examples/train_gpt.py --steps 50                       # attnlab's tiled kernels, causal
    python examples/train_gpt.py --attention flex --window 256    # attnlab.flex, sliding window
    python examples/train_gpt.py --attention sdpa                 # torch SDPA, for comparison

A decoder-only model in the nanoGPT mould (token + position embeddings, pre-LayerNorm blocks of
causal self-attention and an MLP, tied output head), character-level, trained with AdamW on a
corpus that needs no download: the docstrings of a fixed list of Python standard-library
modules (about 780 KB of English with code in it), split 90/10 into train and validation.

Attention backends (``--attention``), the only thing that changes between runs:

* ``attnlab``: :func:`attnlab.tiled.flash_attention` with ``is_causal`` (native kernels).
* ``flex``: :func:`attnlab.flex.flex_attention` with a causal sliding window of ``--window``
  keys (a BlockMask built once; empty blocks are never visited).
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, ``is_causal``, or the same
  sliding window as a dense bool mask when ``--window`` is given.

Prints a progress bar with tokens/s and the loss, and at the end the validation loss.
:func:`train` returns the per-step losses (the tests compare attnlab's with SDPA's);
``--compare attnlab,flex,sdpa`` (:func:`compare`) trains one model per attention, a step of
each in turn, and prints their tokens/s side by side.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab import flex
from attnlab.tiled import flash_attention

CORPUS_MODULES = ("abc", "argparse", "ast", "asyncio", "bisect", "calendar", "collections", "contextlib", "csv",
                  "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools",
                  "heapq", "http.client", "inspect", "io", "itertools", "json", "logging", "operator", "os",
                  "pathlib", "pickle", "random", "re", "shutil", "socket", "statistics", "string", "subprocess",
                  "tarfile", "textwrap", "threading", "unittest", "urllib.parse", "uuid", "zipfile")


def corpus() -> str:
    """The docstrings of :data:`CORPUS_MODULES` and their public members, in a fixed order.

    The same text whatever the process imported before: a package's namespace gains an
    attribute for each submodule anyone imports (``json.tool``, ``email.mime``), so
    submodules are left out. (Walking them grew the text from 991,111 to 991,968 characters
    in one test process, and a CI run trained on other data than a rerun of the same test.)"""
    import importlib

    parts = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            value = getattr(module, attr, None)
            if inspect.ismodule(value):  # present only once something imported it
                continue
            doc = inspect.getdoc(value)
            if doc and len(doc) > 80:
                parts.append(f"{attr}\n{doc}")
    text = "\n\n".join(parts)
    return "".join(c for c in text if c.isascii())


@dataclass
class Config:
    attention: str = "attnlab"  # attnlab | flex | sdpa
    window: Optional[int] = None  # sliding window (flex; sdpa with a dense mask)
    seq_len: int = 256
    batch: int = 8
    layers: int = 4
    heads: int = 4
    dim: int = 128
    steps: int = 200
    lr: float = 1e-3
    seed: int = 0
    eval_batches: int = 4


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.block_mask: Optional[flex.BlockMask] = None
        self.dense_mask: Optional[Tensor] = None
        if cfg.window is not None:
            if cfg.attention == "flex":
                self.block_mask = flex.create_block_mask(flex.sliding_window(cfg.window), None, None, cfg.seq_len,
                                                         cfg.seq_len)
            else:
                i = torch.arange(cfg.seq_len)
                self.dense_mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < cfg.window)  # (L, L)

    def forward(self, x: Tensor) -> Tensor:
        B, L, D = x.shape
        H = self.cfg.heads
        q, k, v = self.qkv(x).split(D, dim=2)  # 3 x (B, L, D)
        q, k, v = (t.view(B, L, H, D // H).transpose(1, 2) for t in (q, k, v))  # (B, H, L, E)
        if self.cfg.attention == "flex":
            if self.block_mask is None:  # no window: plain causal, built on first use
                self.block_mask = flex.create_block_mask(flex.causal_mask, None, None, L, L)
            y = flex.flex_attention(q, k, v, block_mask=self.block_mask)
        elif self.cfg.attention == "attnlab":
            y = flash_attention(q, k, v, is_causal=True)
        else:
            sdpa = torch.nn.functional.scaled_dot_product_attention
            y = sdpa(q, k, v, attn_mask=self.dense_mask) if self.dense_mask is not None else sdpa(q, k, v,
                                                                                                 is_causal=True)
        y = y.transpose(1, 2).reshape(B, L, D)  # (B, L, H * E)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config, vocab: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for module in self.modules():  # GPT-2's init: N(0, 0.02), zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # and the residual projections scaled by depth
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, idx: Tensor, targets: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        B, L = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(L))  # (B, L, D)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))  # (B, L, vocab)
        loss = None if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def _batches(data: Tensor, cfg: Config, generator: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch,), generator=generator)
        x = torch.stack([data[s:s + cfg.seq_len] for s in starts])  # (B, L)
        y = torch.stack([data[s + 1:s + 1 + cfg.seq_len] for s in starts])
        yield x, y


def _bar(step: int, total: int, loss: float, tok_s: float, width: int = 30) -> str:
    filled = int(width * step / max(total, 1))
    # padded: a shorter line after a longer one must not leave the old line's tail ("tok/ss")
    return f"\r[{'#' * filled}{'.' * (width - filled)}] step {step}/{total}  loss {loss:.4f}  {tok_s:,.0f} tok/s".ljust(90)


class Run:
    """One model, its optimiser and its data stream: :meth:`step` trains on one batch.
    Same ``cfg.seed`` -> same initial weights and the same batches, whatever the attention."""

    def __init__(self, cfg: Config, data: Tensor, vocab: int) -> None:
        self.cfg = cfg
        self.split = int(0.9 * len(data))
        self.data = data
        torch.manual_seed(cfg.seed)
        self.model = GPT(cfg, vocab)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.1)
        self.batches = _batches(data[:self.split], cfg, torch.Generator().manual_seed(cfg.seed))
        self.losses: list[float] = []
        self.seconds = 0.0  # time in steps after the first (one-off costs: allocation, block masks)

    def step(self) -> float:
        x, y = next(self.batches)
        t0 = time.perf_counter()
        _, loss = self.model(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.losses:
            self.seconds += time.perf_counter() - t0
        self.losses.append(loss.item())
        return self.losses[-1]

    def tokens_per_s(self) -> float:
        steps = len(self.losses) - 1
        return self.cfg.batch * self.cfg.seq_len * steps / self.seconds if steps > 0 and self.seconds else 0.0

    def validate(self) -> float:
        self.model.eval()
        val = _batches(self.data[self.split:], self.cfg, torch.Generator().manual_seed(self.cfg.seed + 1))
        with torch.no_grad():
            total = sum(self.model(*next(val))[1].item() for _ in range(self.cfg.eval_batches))
        self.model.train()
        return total / self.cfg.eval_batches

    def result(self) -> dict:
        return {"losses": self.losses, "val_loss": self.validate(), "tokens_per_s": self.tokens_per_s()}


def _data(text: str) -> tuple[Tensor, int]:
    chars = sorted(set(text))
    return torch.tensor(_encode(text, chars), dtype=torch.long), len(chars)  # (N,) character ids, vocab


def train(cfg: Config, text: Optional[str] = None, progress: bool = True) -> dict:
    """Train from ``cfg.seed``; returns ``losses`` (per step), ``val_loss`` and ``tokens_per_s``
    (steady state: the first step, with its one-off costs, is left out)."""
    data, vocab = _data(corpus() if text is None else text)
    run = Run(cfg, data, vocab)
    for step in range(1, cfg.steps + 1):
        loss = run.step()
        if progress:
            print(_bar(step, cfg.steps, loss, run.tokens_per_s()), end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return run.result()


def compare(cfgs: list[Config], text: str, progress: bool = True) -> list[dict]:
    """Train one model per config, a step of each in turn (interleaved, so that a noisy
    neighbour slows all of them alike), and return each :meth:`Run.result`."""
    data, vocab = _data(text)
    runs = [Run(cfg, data, vocab) for cfg in cfgs]
    steps = max(cfg.steps for cfg in cfgs)
    for step in range(1, steps + 1):
        for run in runs:
            if step <= run.cfg.steps:
                run.step()
        if progress:
            speeds = "  ".join(f"{r.cfg.attention} {r.tokens_per_s():,.0f}" for r in runs)
            print((_bar(step, steps, runs[0].losses[-1], 0.0).split("  loss")[0] + f"  tok/s: {speeds}").ljust(90), end="",
                  file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return [run.result() for run in runs]


def _encode(text: str, chars: list[str]) -> list[int]:
    index = {c: i for i, c in enumerate(chars)}
    return [index[c] for c in text]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention", choices=["attnlab", "flex", "sdpa"], default="attnlab")
    p.add_argument("--window", type=int, default=None, help="sliding window (flex; sdpa with a dense mask)")
    p.add_argument("--seq-len", type=int, default=Config.seq_len)
    p.add_argument("--batch", type=int, default=Config.batch)
    p.add_argument("--layers", type=int, default=Config.layers)
    p.add_argument("--heads", type=int, default=Config.heads)
    p.add_argument("--dim", type=int, default=Config.dim)
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--lr", type=float, default=Config.lr)
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--compare", metavar="A,B,...", default=None,
                   help="instead: train one model per attention (same seed and data), a step of each in turn, "
                        "and print a table of tokens/s and final losses, e.g. attnlab,flex,sdpa")
    args = p.parse_args(argv)
    if args.attention == "flex" and args.window is None:
        args.window = args.seq_len  # a window as long as the sequence: plain causal
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = Config(args.attention, args.window, args.seq_len, args.batch, args.layers, args.heads, args.dim,
                 args.steps, args.lr, args.seed)
    text = corpus()
    if args.compare:
        names = args.compare.split(",")
        for name in names:
            if name not in ("attnlab", "flex", "sdpa"):
                p.error(f"--compare: unknown attention {name!r}; expected attnlab, flex or sdpa")
        cfgs = [Config(name, args.window if (name != "flex" or args.window) else args.seq_len, args.seq_len,
                       args.batch, args.layers, args.heads, args.dim, args.steps, args.lr, args.seed)
                for name in names]
        results = compare(cfgs, text)
        base = next((r["tokens_per_s"] for c, r in zip(cfgs, results) if c.attention == "sdpa"), None)
        print(f"\nL={args.seq_len}, batch {args.batch}, {args.layers} layers, {args.heads} heads, d={args.dim}, "
              f"{args.steps} steps each, interleaved, {torch.get_num_threads()} threads\n")
        print("| attention | window | tokens/s | x sdpa | final train loss | validation loss |")
        print("|---|---|---|---|---|---|")
        for c, r in zip(cfgs, results):
            ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
            print(f"| {c.attention} | {c.window or '-'} | {r['tokens_per_s']:,.0f} | {ratio} | {r['losses'][-1]:.4f} | "
                  f"{r['val_loss']:.4f} |")
        return 0
    print(f"corpus: {len(text):,} characters of standard-library docstrings; attention: {cfg.attention}"
          + (f" (sliding window {cfg.window})" if cfg.window else " (causal)")
          + f"; {cfg.layers} layers, {cfg.heads} heads, d={cfg.dim}, L={cfg.seq_len}, batch {cfg.batch}")
    result = train(cfg, text)
    print(f"done: train loss {result['losses'][-1]:.4f} (from {result['losses'][0]:.4f}), validation loss "
          f"{result['val_loss']:.4f}, {result['tokens_per_s']:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
