"""``attnlab explain``: one self-contained HTML page that walks through the worked example.

Everything is inline (CSS, a few lines of JS, SVG heatmaps drawn by matplotlib): the
page opens offline, from a file, in any browser. Each step has its heading, shape, a
text equivalent (what a screen reader reads), the numbers as a table and a heatmap.
A checkbox switches between the plain and the causal run, both computed up front.
"""

from __future__ import annotations

import html
import io
import sys
from dataclasses import replace

import torch

from attnlab.example import ExampleConfig, WorkedExample, run_example
from attnlab.trace import STEP_DESCRIPTIONS

__all__ = ["explain_html", "MAX_POSITIONS"]

MAX_POSITIONS = 64

_TEXT = {
    "X": "The input: one row per position, one column per embedding feature.",
    "Q": "Queries: each position's embedding times W_Q. A query asks what this position should look at.",
    "K": "Keys: each position's embedding times W_K. A key says what this position offers.",
    "V": "Values: each position's embedding times W_V. A value is what this position passes on.",
    "scores": "Scores: every query against every key, divided by the square root of d_k. Row i, column j "
              "is how well query i matches key j.",
    "masked_scores": "The causal mask sets the scores above the diagonal to minus infinity: position i "
                     "cannot look at later positions.",
    "scores_shifted": "Each row minus its maximum, so every exponent is at most 0 and exp cannot overflow.",
    "weights": "Softmax of each row: the weights are between 0 and 1 and every row sums to 1.",
    "output": "Each position's output is the weighted sum of the value rows, with its row of weights.",
}

_CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em} h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ccc}
.shape{font-family:monospace;color:#555} .text{max-width:60em}
table.m{border-collapse:collapse;font-family:monospace;font-size:12px;margin:.5em 0}
table.m td{border:1px solid #ddd;padding:2px 6px;text-align:right}
table.m td.masked{background:#e0e0e0;color:#777}
figure{margin:.5em 0} figure svg{max-width:100%;height:auto}
.variant[hidden]{display:none} .controls{position:sticky;top:0;background:#fff;padding:.5em 0}
.warning{background:#fff3cd;padding:.5em}
"""

_JS = """
(function(){
  var box=document.getElementById('causal');
  function show(){
    document.querySelectorAll('.variant').forEach(function(v){
      v.hidden=(v.dataset.causal==='1')!==box.checked;});
  }
  box.addEventListener('change',show); show();
  document.body.dataset.ready='yes';
})();
"""


def _svg(tensor: torch.Tensor, name: str, trace) -> str:
    import matplotlib.pyplot as plt

    from attnlab import viz

    kind = {"scores": "scores", "masked_scores": "scores", "scores_shifted": "scores",
            "weights": "weights"}.get(name, "values")
    keep = ~torch.isneginf(trace["masked_scores"]) if (name == "weights" and "masked_scores" in trace) else None
    fig, ax = plt.subplots(figsize=(5.5, 3.6), constrained_layout=True)
    viz.heatmap(tensor, kind=kind, ax=ax, mask=keep, title=f"{name} {list(tensor.shape)} (batch 0)")
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog: the SVG is inline


def _table(t: torch.Tensor, name: str) -> str:
    m = t.detach().double()
    while m.dim() > 2:
        m = m[0]
    if m.dim() == 1:
        m = m[None]
    fmt = "{:.2e}" if name == "weights" else "{:.4f}"
    rows = []
    for row in m.tolist():
        cells = []
        for v in row:
            if v == float("-inf"):
                cells.append('<td class="masked">-inf</td>')
            else:
                cells.append(f"<td>{fmt.format(v)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="m" aria-label="{html.escape(name)} values">' + "".join(rows) + "</table>"


def _variant(result: WorkedExample, causal: bool) -> str:
    parts = [f'<div class="variant" data-causal="{int(causal)}">']
    for n, step in enumerate(result.trace, 1):
        name = step.name
        parts.append(f'<section><h2>Step {n}: {html.escape(name)}</h2>'
                     f'<p class="shape">shape {list(step.shape)} - {html.escape(STEP_DESCRIPTIONS.get(name, ""))}</p>'
                     f'<p class="text">{html.escape(_TEXT.get(name, ""))}</p>'
                     f'{_table(step.tensor, name)}'
                     f'<figure role="img" aria-label="heatmap of {html.escape(name)}">{_svg(step.tensor, name, result.trace)}'
                     f'<figcaption>heatmap of {html.escape(name)}: colour = value; grey hatched = masked</figcaption>'
                     f'</figure></section>')
    parts.append(f"<p>Parity with torch's scaled_dot_product_attention (MATH backend): max |difference| = "
                 f"{result.max_abs_diff_vs_sdpa:.3e}.</p></div>")
    return "".join(parts)


def explain_html(config: ExampleConfig = ExampleConfig()) -> str:
    """The page for ``config`` (its ``causal`` field sets the checkbox's initial state)."""
    if config.seq_len > MAX_POSITIONS:
        print(f"attnlab explain: warning: {config.seq_len} positions (> {MAX_POSITIONS}) make a very large page",
              file=sys.stderr)
    plain = run_example(replace(config, causal=False))
    causal = run_example(replace(config, causal=True))
    c = config
    checked = " checked" if config.causal else ""
    warning = (f'<p class="warning">{c.seq_len} positions: tables and heatmaps this large are hard to read.</p>'
               if c.seq_len > MAX_POSITIONS else "")
    return (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<title>attnlab: self-attention, step by step</title>"
        f"<style>{_CSS}</style></head><body>"
        "<h1>Self-attention, step by step</h1>"
        f"<p>The lesson's worked example: seed {c.seed}, B={c.batch}, T={c.seq_len}, d={c.d_model}, "
        f"d_k={c.d_k}, d_v={c.d_v}, {c.dtype}. Each step shows its shape, what it means, its numbers "
        "(batch element 0) and a heatmap.</p>"
        f"{warning}"
        f'<div class="controls"><label><input type="checkbox" id="causal"{checked}> '
        "causal mask (position i sees positions 0..i)</label></div>"
        f"{_variant(plain, False)}{_variant(causal, True)}"
        f"<script>{_JS}</script></body></html>"
    )
