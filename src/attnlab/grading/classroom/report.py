"""The class report: one self-contained HTML page (no network) for an instructor.

Every learner with their score, status and named mistakes (a table sorted by clicking a
header, or by opening the page as ``report.html#sort=score``), the submissions that could
not be read and why, the score distribution (an inline SVG histogram), each exercise's pass
rate, the named mistakes ranked by how many learners made them (with the shared explanation
from :mod:`attnlab.mistakes` and one anonymised example message), the failures no code names
grouped by how they fail (:func:`attnlab.grading.classroom.batch.failure_signature`), the slowest submissions,
and what was skipped. It reads at phone width: the histogram scales, wide tables scroll
inside their box.

Every piece of learner-derived text is HTML-escaped: a submission's output may try to
inject markup. The page's one script (the sorting) is allowed by its SHA-256 in the
Content-Security-Policy and nothing else may run.
"""

from __future__ import annotations

import base64
import hashlib
import html
import os
from collections import Counter
from pathlib import Path

from attnlab import mistakes

__all__ = ["render_report", "write_report"]

_CSS = """
body{font:15px/1.45 system-ui,sans-serif;margin:2em auto;max-width:60em;color:#222;padding:0 1em}
.scroll{overflow-x:auto;max-width:100%}svg{max-width:100%;height:auto}li,p,h1,td.codes{overflow-wrap:anywhere}
th button{font:inherit;font-weight:bold;background:none;border:0;padding:0;cursor:pointer}
th button::after{content:" \\2195";color:#999}
@media (max-width:40em){body{margin:1em auto;font-size:14px}td,th{padding:.2em .3em}}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;width:100%}td,th{padding:.25em .5em;border-bottom:1px solid #eee;text-align:left;
vertical-align:top}th{background:#f6f6f6}.bar{background:#4a7ebb;height:.8em;display:inline-block}
.num{text-align:right;font-variant-numeric:tabular-nums}.ex{color:#555;font-size:.9em;white-space:pre-wrap}
.muted{color:#777}code{background:#f3f3f3;padding:0 .2em}
"""


# Sorts the learner table by a header's key (clicking it again reverses), and on load by the
# page's #sort=KEY or #sort=KEY-desc; then records whether the page is wider than the window
# (body data-overflow), which the headless-Chromium test reads at 1280 and 390 px.
_SCRIPT = """
(function(){
  var table=document.getElementById('learner-table'); if(!table) return;
  var body=table.tBodies[0], state={key:null,desc:false};
  function value(tr,key){var v=tr.getAttribute('data-'+key); return key==='score'?parseFloat(v):v;}
  function sort(key,desc){
    var rows=Array.prototype.slice.call(body.rows);
    rows.sort(function(a,b){var x=value(a,key),y=value(b,key); var c=x<y?-1:x>y?1:0;
      if(c===0){c=value(a,'name')<value(b,'name')?-1:1;} return desc?-c:c;});
    rows.forEach(function(r){body.appendChild(r);}); state={key:key,desc:desc};
    table.setAttribute('data-sorted',key+(desc?'-desc':''));
  }
  Array.prototype.forEach.call(table.querySelectorAll('th button'),function(b){
    b.addEventListener('click',function(){var k=b.getAttribute('data-key'); sort(k,state.key===k&&!state.desc);});
  });
  var m=/sort=(name|score|status)(-desc)?/.exec(location.hash); if(m) sort(m[1],!!m[2]);
  document.body.setAttribute('data-overflow',
    document.documentElement.scrollWidth>window.innerWidth+1?'yes':'no');
})();
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
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h + 40}" width="{w}" height="{h + 40}" '
             f'role="img" aria-label="score distribution">']
    for i, c in enumerate(counts):
        bh = (h - 20) * c / top
        x = pad + i * bw
        parts.append(f'<rect x="{x + 2:.1f}" y="{h - bh:.1f}" width="{bw - 4:.1f}" height="{bh:.1f}" fill="#4a7ebb">'
                     f'<title>{c} learner{"" if c == 1 else "s"}</title></rect>')
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
    """The page for a :class:`attnlab.grading.classroom.batch.ClassResult`, as a string."""
    rows = result.rows
    n = len(rows)
    max_total = max((r.max_total for r in rows), default=0.0)
    totals = [r.total for r in rows]
    mean = sum(totals) / n if n else 0.0
    full = sum(1 for r in rows if r.total == r.max_total)
    script_hash = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
    learners = f"{n} learner{'' if n == 1 else 's'}"
    out = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
           "<meta name='viewport' content='width=device-width, initial-scale=1'>",
           "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'; "
           f"img-src data:; script-src 'sha256-{script_hash}'\">",
           f"<title>attnlab class report: {learners}</title><style>{_CSS}</style></head><body>",
           f"<h1>attnlab class report: lab {_e(result.lab.name)}</h1><p>{learners} graded; mean {mean:.1f}/{max_total:g}; "
           f"{full} with every check passing; {len(result.skipped)} entries skipped; "
           f"{result.seconds:.0f} s of grading.</p>",
           f"<p class='muted'>Sandboxes: {_e(result.sandboxes)}.</p>" if result.sandboxes else ""]

    out.append("<h2 id='learners'>Learners</h2><p class='muted'>Click a header to sort.</p><div class='scroll'>"
               "<table id='learner-table'><thead><tr><th><button data-key='name'>learner</button></th>"
               "<th class='num'><button data-key='score'>score</button></th>"
               "<th><button data-key='status'>status</button></th><th>mistakes named</th></tr></thead><tbody>")
    for r in sorted(rows, key=lambda r: r.learner):
        link = f"<a href='{_e(r.folder)}/feedback.html'>{_e(r.learner)}</a>" if r.folder else _e(r.learner)
        out.append(f"<tr data-name='{_e(r.learner.casefold())}' data-score='{r.total:g}' data-status='{_e(r.status)}'>"
                   f"<td>{link}</td><td class='num'>{r.total:g}/{r.max_total:g}</td><td>{_e(r.status)}</td>"
                   f"<td class='codes'>{' '.join(f'<code>{_e(c)}</code>' for c in r.mistakes) or '-'}</td></tr>")
    out.append("</tbody></table></div>")
    unread = [r for r in rows if r.status in ("could not be read", "grader error", "grader environment")]
    if unread:
        out.append(f"<h2 id='unread'>Not graded normally ({len(unread)})</h2><ul>"
                   + "".join(f"<li><b>{_e(r.learner)}</b> ({_e(r.status)}):<div class='ex'>"
                             f"{_e(r.problem or 'no reason recorded')}</div></li>" for r in unread) + "</ul>")
    similar = [r for r in rows if getattr(r, "similar", None)]
    out.append("<h2 id='similar'>Identical or near-identical submissions</h2>")
    if similar:
        groups = {tuple(sorted([r.learner, *r.similar])) for r in similar}
        out.append("<p class='muted'>The same file, or one that differs only in names, strings, comments and "
                   "docstrings (the shape of its syntax tree). A hint to look, not a verdict: short solutions can "
                   "coincide.</p><ul>" + "".join(f"<li>{', '.join(_e(n) for n in g)}</li>" for g in sorted(groups))
                   + "</ul>")
    else:
        out.append("<p class='muted'>None: no two submissions share a file or its shape.</p>")

    out.append("<h2 id='distribution'>Score distribution</h2>")
    out.append(_histogram(totals, max_total) if n else "<p class='muted'>no learners</p>")

    out.append("<h2 id='exercises'>Exercises: pass rate</h2><div class='scroll'><table><tr><th>exercise</th><th>function</th>"
               "<th class='num'>full marks</th><th></th><th class='num'>mean points</th></tr>")
    for ex in result.lab.exercises():
        pts = sum(ex.checks.values())
        passed = sum(1 for r in rows if r.exercises.get(ex.id, 0) >= pts)
        rate = passed / n if n else 0.0
        avg = sum(r.exercises.get(ex.id, 0) for r in rows) / n if n else 0.0
        out.append(f"<tr><td>{_e(ex.id)}</td><td><code>{_e(ex.function)}</code></td><td class='num'>"
                   f"{100 * rate:.0f}%</td><td style='min-width:5em'><span class='bar' style='width:{100 * rate:.0f}%'></span></td>"
                   f"<td class='num'>{avg:.1f}/{pts:g}</td></tr>")
    out.append("</table></div>")

    counts = Counter(code for r in rows for code in r.mistakes)
    out.append("<h2 id='mistakes'>Named mistakes, by how many learners made them</h2>")
    if counts:
        out.append("<div class='scroll'><table><tr><th>mistake</th><th class='num'>learners</th><th>what it means</th>"
                   "<th>an example (anonymised)</th></tr>")
        for code, c in counts.most_common():
            example = next((_anonymise(r.messages.get(code, ""), r.learner) for r in rows if code in r.mistakes), "")
            out.append(f"<tr><td><code>{_e(code)}</code></td><td class='num'>{c} ({100 * c / n:.0f}%)</td>"
                       f"<td>{_e(mistakes.CODES.get(code, 'no explanation recorded'))}</td>"
                       f"<td class='ex'>{_e(example[:400])}</td></tr>")
        out.append("</table></div>")
    else:
        out.append("<p class='muted'>No named mistakes.</p>")

    groups: dict[str, list] = {}
    for r in rows:
        for signature in r.unnamed:
            groups.setdefault(signature, []).append(r)
    out.append("<h2 id='unnamed'>Failures no code names, grouped by how they fail</h2>")
    if groups:
        out.append("<p class='muted'>Learners whose exercise failed the same checks in the same way (numbers and "
                   "quoted text aside) with no named mistake: a mistake the class shares that the grader has no name "
                   "for yet.</p><div class='scroll'><table><tr><th>how it fails</th><th class='num'>learners</th>"
                   "<th>an example (anonymised)</th></tr>")
        for signature, who in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            example = _anonymise(who[0].unnamed[signature], who[0].learner)
            out.append(f"<tr><td><code>{_e(signature)}</code></td><td class='num'>{len(who)} ({100 * len(who) / n:.0f}%)"
                       f"</td><td class='ex'>{_e(example[:400])}</td></tr>")
        out.append("</table></div>")
    else:
        out.append("<p class='muted'>None: every failed check named its mistake.</p>")

    out.append("<h2 id='slowest'>Slowest submissions</h2><div class='scroll'><table><tr><th>learner</th><th class='num'>seconds</th>"
               "<th>status</th><th class='num'>score</th></tr>")
    for r in sorted(rows, key=lambda r: -r.seconds)[:5]:
        out.append(f"<tr><td>{_e(r.learner)}</td><td class='num'>{r.seconds:.1f}</td><td>{_e(r.status)}</td>"
                   f"<td class='num'>{r.total:g}/{r.max_total:g}</td></tr>")
    out.append("</table></div>")

    statuses = Counter(r.status for r in rows)
    out.append("<h2 id='status'>Status</h2><p>" + ", ".join(f"{_e(k)}: {v}" for k, v in sorted(statuses.items()))
               + "</p>")
    if result.skipped:
        out.append("<h2 id='skipped'>Skipped</h2><ul>" + "".join(f"<li><code>{_e(s.name)}</code>: {_e(s.reason)}</li>"
                                                                   for s in result.skipped) + "</ul>")
    out.append("<p class='muted'>grades.csv and each learner's results.json and feedback.html (in the folder its row "
               "names; the learner's name links to it) are beside this page.</p>")
    out.append(f"<script>{_SCRIPT}</script></body></html>")
    return "\n".join(out)


def write_report(result, path: os.PathLike) -> None:
    """The page at ``path``, through the output boundary (:func:`attnlab.grading.output.write_text`)."""
    from attnlab.grading.output import write_text

    write_text(path, render_report(result))
