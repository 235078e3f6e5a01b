"""``attnlab plot`` and ``attnlab explain``: the worked example as a picture and as a page."""

from __future__ import annotations

import argparse

from attnlab.cli._args import UsageError, add_example_options, example_config, need_module, output_file

# The page holds a T x T table and heatmap per step: past 64 positions it warns (viz.explain), past
# this it refuses (at 256 the page measured ~10 MB; at 1000 it would be ~150 MB).
EXPLAIN_MAX_POSITIONS = 256


def add(sub) -> None:
    pl = sub.add_parser("plot", help="draw the worked example's four panels to a PNG or SVG",
                        description="Draw the lesson's four panels (X -> Q, K, V; scores with the mask; weights; "
                                    "output) with the real numbers of a run. Needs matplotlib "
                                    "(pip install 'attnlab[viz]').",
                        epilog="examples:\n  attnlab plot example --out steps.png --causal\n"
                               "  attnlab plot example --out steps.svg --seq-len 8",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    pl.add_argument("what", choices=["example"], help="what to draw")
    pl.add_argument("--out", required=True, type=output_file(".png", ".svg"), help="output file, .png or .svg")
    add_example_options(pl)
    pl.set_defaults(func=run_plot)

    ex = sub.add_parser("explain", help="write one offline HTML page that walks through the worked example",
                        description="Write a self-contained HTML page (inline CSS, JS and SVG; nothing is fetched) "
                                    "with each step's matrix, heatmap, shape and a text equivalent, and a "
                                    f"checkbox for the causal mask. Best up to 64 positions (a warning above), at most {EXPLAIN_MAX_POSITIONS}. "
                                    "Needs matplotlib (pip install 'attnlab[viz]').",
                        epilog="examples:\n  attnlab explain --out explain.html\n"
                               "  attnlab explain --out explain.html --seq-len 8 --causal",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ex.add_argument("--out", required=True, type=output_file(".html", ".htm"), help="the HTML file to write")
    add_example_options(ex)
    ex.set_defaults(func=run_explain)


def run_plot(args: argparse.Namespace) -> int:
    need_module("matplotlib", "viz", "attnlab plot")
    config = example_config(args)
    from attnlab import viz
    from attnlab.example import run_example

    viz.save(viz.steps(run_example(config).trace), args.out)
    print(f"wrote {args.out}")
    return 0


def run_explain(args: argparse.Namespace) -> int:
    need_module("matplotlib", "viz", "attnlab explain")
    if args.seq_len > EXPLAIN_MAX_POSITIONS:
        raise UsageError(f"--seq-len {args.seq_len}: the page shows at most {EXPLAIN_MAX_POSITIONS} positions "
                         f"(its tables would be unreadable); use 'attnlab plot example' for larger sizes")
    config = example_config(args)
    from attnlab.viz.explain import explain_html

    page = explain_html(config)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(page)
    print(f"wrote {args.out} ({len(page) // 1024} KB); open it in any browser, no network needed")
    return 0
