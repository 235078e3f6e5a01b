"""Pictures of attention: heatmaps, the lesson's four panels, learner vs reference.

Needs matplotlib (``pip install 'attnlab[viz]'``); importing this package without it
works, calling a function raises an ``ImportError`` that says how to install it.

* :func:`heatmap`: one query x key matrix; weights on a fixed 0-1 scale (viridis),
  scores on a diverging scale centred at 0 (RdBu), masked cells grey and hatched,
  row sums in the margin for weights, numbers in the cells when the matrix is small.
* :func:`steps`: the four panels of a traced forward pass (X -> Q, K, V; scores with
  the mask; weights; output), each title with its shape.
* :func:`compare`: learner vs reference vs |difference|.

Colour maps are colour-blind safe (viridis, cividis, RdBu).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from attnlab.trace import AttentionTrace

__all__ = ["heatmap", "steps", "compare", "save", "matplotlib_available"]

TICKS_MAX = 48  # rows or columns labelled one by one; beyond, a few integer ticks
ANNOTATE_MAX_CELLS = 64


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("attnlab.viz needs matplotlib: pip install 'attnlab[viz]'") from None
    return plt


def _as_2d(t: Tensor, name: str) -> Tensor:
    """The first matrix of a (..., R, C) tensor, in float64 on the CPU."""
    if not isinstance(t, Tensor) or t.dim() < 1:
        raise ValueError(f"{name}: expected a tensor with at least one dim, got {getattr(t, 'shape', type(t))}")
    t = t.detach().to("cpu", torch.float64)
    if t.dim() == 1:
        return t[None, :]
    while t.dim() > 2:
        t = t[0]
    return t


def heatmap(matrix: Tensor, *, kind: str = "weights", tokens: Optional[Sequence[str]] = None,
            key_tokens: Optional[Sequence[str]] = None, mask: Optional[Tensor] = None, ax=None,
            title: Optional[str] = None, annotate: Optional[bool] = None,
            limit: Optional[float] = None):
    """Draw one ``(L, S)`` matrix (queries down, keys across) and return the Axes.

    Args:
        matrix: ``(L, S)``; for more dims the first matrix (``matrix[0, ..., 0]``) is drawn.
        kind: ``"weights"`` (0-1 scale, row sums in the margin), ``"scores"`` (diverging,
            centred at 0) or ``"values"`` (diverging, for Q, K, V and outputs).
        tokens, key_tokens: tick labels for the rows (queries) and columns (keys).
        mask: bool ``(L, S)``, False = masked; cells that are ``-inf`` count as masked too.
        annotate: print the numbers in the cells (default: when there are <= 64 cells).
        limit: for ``"scores"``/``"values"``, the colour scale is ``[-limit, limit]`` (default:
            this matrix's largest finite ``|value|``); pass one limit to draw two matrices
            on the same scale.
    """
    plt = _plt()
    import numpy as np

    if kind not in ("weights", "scores", "values"):
        raise ValueError(f"heatmap: kind must be 'weights', 'scores' or 'values', got {kind!r}")
    m = _as_2d(matrix, "heatmap")
    hidden = torch.isneginf(m)
    if mask is not None:
        hidden = hidden | ~_as_2d(mask.to(torch.float64), "heatmap mask").bool()
    data = np.ma.masked_array(m.numpy(), mask=hidden.numpy())
    ax = ax if ax is not None else plt.subplots(figsize=(1 + 0.5 * m.shape[1], 1 + 0.5 * m.shape[0]))[1]
    if kind == "weights":
        cmap, vmin, vmax = plt.get_cmap("viridis"), 0.0, 1.0
    else:
        finite = m[~hidden & torch.isfinite(m)]
        lim = limit if limit is not None else (float(finite.abs().max()) if finite.numel() else 1.0)
        cmap, vmin, vmax = plt.get_cmap("RdBu_r"), -lim or -1.0, lim or 1.0
    cmap = cmap.with_extremes(bad="#d0d0d0")  # masked cells: grey (and hatched below)
    image = ax.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    cells = hidden.nonzero().tolist()
    if cells:  # hatch the masked cells, not only grey: one collection (a patch per cell took ~1 ms each)
        from matplotlib.collections import PatchCollection

        ax.add_collection(PatchCollection([plt.Rectangle((j - 0.5, i - 0.5), 1, 1) for i, j in cells],
                                          facecolor="none", hatch="///", edgecolor="#808080", linewidth=0,
                                          label="masked"))
    L, S = m.shape
    if annotate if annotate is not None else L * S <= ANNOTATE_MAX_CELLS:
        for i in range(L):
            for j in range(S):
                if not hidden[i, j]:
                    v = float(m[i, j])
                    text = f"{v:.2f}" if kind == "weights" else f"{v:.1f}"
                    dark = (v - vmin) / (vmax - vmin) < 0.6 if kind == "weights" else abs(v) > 0.6 * vmax
                    ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    if kind == "weights":
        sums = torch.where(hidden, torch.zeros_like(m), m).sum(-1)
        for i in range(L):
            ax.text(S - 0.3, i, f" Σ={float(sums[i]):.2f}", va="center", ha="left", fontsize=7)
    _ticks(ax.xaxis, S, key_tokens or tokens)
    _ticks(ax.yaxis, L, tokens)
    ax.set_xlabel("feature" if kind == "values" else "key")
    ax.set_ylabel("position" if kind == "values" else "query")
    if title:
        ax.set_title(title, fontsize=9)
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.12 if kind == "weights" else 0.04)
    return ax


def _ticks(axis, n: int, labels: Optional[Sequence[str]]) -> None:
    """One tick per row/column with its label where they fit; else a few integer ticks
    (a tick per position of a 4096-long sequence took matplotlib ~20 s per picture)."""
    from matplotlib.ticker import MaxNLocator

    if labels is not None or n <= TICKS_MAX:
        axis.set_ticks(range(n))
        axis.set_ticklabels(list(labels if labels is not None else range(n))[:n], fontsize=7)
    else:
        axis.set_major_locator(MaxNLocator(nbins=8, integer=True))
        axis.set_tick_params(labelsize=7)


def steps(trace: AttentionTrace, *, title: Optional[str] = None):
    """The lesson's four panels from a traced forward pass (batch element 0); returns the Figure.

    A: X -> Q, K, V.  B: scores = Q K^T / sqrt(d_k) (with the mask, if any).
    C: weights = softmax of the scores.  D: output = weights @ V.
    """
    plt = _plt()
    fig = plt.figure(figsize=(15, 8), constrained_layout=True)
    grid = fig.add_gridspec(2, 4)
    for col, name in enumerate(["X", "Q", "K", "V"]):
        ax = fig.add_subplot(grid[0, col])
        heatmap(trace[name], kind="values", ax=ax, annotate=False,
                title=f"A: {name} {list(trace[name].shape)}")
        ax.set_xlabel("feature")
        ax.set_ylabel("position")
    scores_name = "masked_scores" if "masked_scores" in trace else "scores"
    ax = fig.add_subplot(grid[1, 0:2])
    heatmap(trace[scores_name], kind="scores", ax=ax,
            title=f"B: scores = Q K^T / sqrt(d_k) {list(trace[scores_name].shape)}"
                  + (" (masked: grey)" if scores_name == "masked_scores" else ""))
    ax = fig.add_subplot(grid[1, 2])
    keep = ~torch.isneginf(trace["masked_scores"]) if "masked_scores" in trace else None
    heatmap(trace["weights"], kind="weights", ax=ax, mask=keep, title=f"C: weights {list(trace['weights'].shape)}")
    ax = fig.add_subplot(grid[1, 3])
    heatmap(trace["output"], kind="values", ax=ax, title=f"D: output = weights @ V {list(trace['output'].shape)}")
    ax.set_xlabel("feature")
    ax.set_ylabel("position")
    fig.suptitle(title or "self-attention, step by step (batch element 0)")
    return fig


def compare(learner: Tensor, reference: Tensor, *, name: str = "output", kind: str = "values"):
    """Learner | reference | |learner - reference| side by side, yours and the reference on one
    colour scale (so a 2x error shows as a darker picture); returns the Figure."""
    plt = _plt()
    a, b = _as_2d(learner, "compare"), _as_2d(reference, "compare")
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    both = torch.cat([a.flatten(), b.flatten()])
    both = both[torch.isfinite(both)]
    limit = (float(both.abs().max()) or 1.0) if both.numel() else None
    heatmap(a, kind=kind, ax=axes[0], title=f"yours: {name} {list(learner.shape)}", limit=limit)
    heatmap(b, kind=kind, ax=axes[1], title=f"reference: {name} {list(reference.shape)}", limit=limit)
    if a.shape == b.shape:
        diff = (a - b).abs().nan_to_num(nan=float("inf"))
        axes[2].imshow(diff.clamp(max=1e30).numpy(), cmap="cividis", aspect="auto", interpolation="nearest")
        axes[2].set_title(f"|yours - reference|, max {float(diff.max()):.3g}", fontsize=9)
    else:
        axes[2].text(0.5, 0.5, f"shapes differ:\n{list(learner.shape)} vs {list(reference.shape)}",
                     ha="center", va="center")
        axes[2].set_axis_off()
    return fig


def save(fig, path: str) -> str:
    """Save a Figure (PNG or SVG by the file's extension) and close it; returns the path."""
    plt = _plt()
    if not str(path).lower().endswith((".png", ".svg")):
        raise ValueError(f"save: the file must end in .png or .svg, got {path!r}")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
