"""The class report: one self-contained HTML page (no scripts, no network) for an instructor.

Score distribution (an inline SVG histogram), each exercise's pass rate, the named mistakes
ranked by how many learners made them (with the shared explanation from
:mod:`attnlab.mistakes` and one anonymised example message), the slowest submissions, and
what was skipped. Every piece of learner-derived text is HTML-escaped: a submission's output
may try to inject markup.
"""

from __future__ import annotations

import html
import os
from collections import Counter
from pathlib import Path

from attnlab import labs, mistakes

__all__ = ["render_report", "write_report"]

_CSS = """
body{font:15px/1.45 system-ui,sans-serif;margin:2em auto;max-width:60em;color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;width:100%}td,th{padding:.25em .5em;border-bottom:1px solid #eee;text-align:left;
vertical-align:top}th{background:#f6f6f6}.bar{background:#4a7ebb;height:.8em;display:inline-block}
.num{text-align:right;font-variant-numeric:tabular-nums}.ex{color:#555;font-size:.9em;white-space:pre-wrap}
.muted{color:#777}code{background:#f3f3f3;padding:0 .2em}
"""


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _histogram(scores: list[float], max_score: float, bins: int = 10) -> str:
    """An SVG histogram of the totals in ``bins`` equal bins over [0, max_score]."""
    counts = [0] * bins
    for s in scores:
        i = min(bins - 1, int(bins * s / max_score)) if max_score > 0 else 0
        counts[i] += 1
    top = max(counts) or 1
    w, h, pad = 600, 200, 30
    bw = (w - 2 * pad) / bins
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h + 40}" role="img" '
             f'aria-label="score distribution">']
    for i, c in enumerate(counts):
        bh = (h - 20) * c / top
        x = pad + i * bw
        parts.append(f'<rect x="{x + 2:.1f}" y="{h - bh:.1f}" width="{bw - 4:.1f}" height="{bh:.1f}" fill="#4a7ebb">'
                     f'<title>{c} learners</title></rect>')
        if c:
            parts.append(f'<text x="{x + bw / 2:.1f}" y="{h - bh - 4:.1f}" font-size="12" text-anchor="middle">{c}'
                         f'</text>')
        lo = max_score * i / bins
        parts.append(f'<text x="{x + bw / 2:.1f}" y="{h + 16}" font-size="11" text-anchor="middle">{lo:g}-'
                     f'{max_score * (i + 1) / bins:g}</text>')
    parts.append(f'<line x1="{pad}" y1="{h}" x2="{w - pad}" y2="{h}" stroke="#333"/>')
    parts.append(f'<text x="{w / 2}" y="{h + 34}" font-size="12" text-anchor="middle">total score</text></svg>')
    return "".join(parts)


def _anonymise(text: str, learner: str) -> str:
    return text.replace(learner, "<learner>") if learner else text


def render_report(result) -> str:
    """The page for a :class:`attnlab.grading.batch.ClassResult`, as a string."""
    rows = result.rows
    n = len(rows)
    max_total = max((r.max_total for r in rows), default=0.0)
    totals = [r.total for r in rows]
    mean = sum(totals) / n if n else 0.0
    full = sum(1 for r in rows if r.total == r.max_total)
    out = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
           "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'; "
           "img-src data:\">",
           f"<title>attnlab class report: {n} learners</title><style>{_CSS}</style></head><body>",
           f"<h1>attnlab class report: lab {_e(result.lab)}</h1><p>{n} learners graded; mean {mean:.1f}/{max_total:g}; "
           f"{full} with every check passing; {len(result.skipped)} entries skipped; "
           f"{result.seconds:.0f} s of grading.</p>",
           f"<p class='muted'>Sandboxes: {_e(result.sandboxes)}.</p>" if result.sandboxes else ""]

    out.append("<h2 id='distribution'>Score distribution</h2>")
    out.append(_histogram(totals, max_total) if n else "<p class='muted'>no learners</p>")

    out.append("<h2 id='exercises'>Exercises: pass rate</h2><table><tr><th>exercise</th><th>function</th>"
               "<th class='num'>full marks</th><th></th><th class='num'>mean points</th></tr>")
    for ex in labs.find_lab(result.lab).exercises():
        pts = sum(ex.checks.values())
        passed = sum(1 for r in rows if r.exercises.get(ex.id, 0) >= pts)
        rate = passed / n if n else 0.0
        avg = sum(r.exercises.get(ex.id, 0) for r in rows) / n if n else 0.0
        out.append(f"<tr><td>{_e(ex.id)}</td><td><code>{_e(ex.function)}</code></td><td class='num'>"
                   f"{100 * rate:.0f}%</td><td><span class='bar' style='width:{200 * rate:.0f}px'></span></td>"
                   f"<td class='num'>{avg:.1f}/{pts:g}</td></tr>")
    out.append("</table>")

    counts = Counter(code for r in rows for code in r.mistakes)
    out.append("<h2 id='mistakes'>Named mistakes, by how many learners made them</h2>")
    if counts:
        out.append("<table><tr><th>mistake</th><th class='num'>learners</th><th>what it means</th>"
                   "<th>an example (anonymised)</th></tr>")
        for code, c in counts.most_common():
            example = next((_anonymise(r.messages.get(code, ""), r.learner) for r in rows if code in r.mistakes), "")
            out.append(f"<tr><td><code>{_e(code)}</code></td><td class='num'>{c} ({100 * c / n:.0f}%)</td>"
                       f"<td>{_e(mistakes.CODES.get(code, 'no explanation recorded'))}</td>"
                       f"<td class='ex'>{_e(example[:400])}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p class='muted'>No named mistakes.</p>")

    out.append("<h2 id='slowest'>Slowest submissions</h2><table><tr><th>learner</th><th class='num'>seconds</th>"
               "<th>status</th><th class='num'>score</th></tr>")
    for r in sorted(rows, key=lambda r: -r.seconds)[:5]:
        out.append(f"<tr><td>{_e(r.learner)}</td><td class='num'>{r.seconds:.1f}</td><td>{_e(r.status)}</td>"
                   f"<td class='num'>{r.total:g}/{r.max_total:g}</td></tr>")
    out.append("</table>")

    statuses = Counter(r.status for r in rows)
    out.append("<h2 id='status'>Status</h2><p>" + ", ".join(f"{_e(k)}: {v}" for k, v in sorted(statuses.items()))
               + "</p>")
    if result.skipped:
        out.append("<h2 id='skipped'>Skipped</h2><ul>" + "".join(f"<li><code>{_e(s.name)}</code>: {_e(s.reason)}</li>"
                                                                   for s in result.skipped) + "</ul>")
    out.append("<p class='muted'>grades.csv and each learner's results.json are beside this page.</p></body></html>")
    return "\n".join(out)


def write_report(result, path: os.PathLike) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render_report(result), encoding="utf-8")
    os.replace(tmp, path)
