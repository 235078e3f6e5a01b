"""``attnlab example``: the lesson's worked example, step by step."""

from __future__ import annotations

import argparse
import json

from attnlab.cli._args import add_example_options, example_config

HELP = """\
Reproduce the lesson's worked example: draw X, W_Q, W_K, W_V with the given seed,
run attnlab's from-scratch self-attention step by step, print every intermediate
tensor with its name and shape (projections, scores, max-shifted scores, weights,
output), then check the output against torch's own scaled_dot_product_attention
(MATH backend) and print the largest absolute difference.

With the defaults (seed 42, B=1, T=4, d=8, d_k=d_v=4, float32) the numbers are the
lesson's, which it rounds to 4 decimals.

examples:
  attnlab example
  attnlab example --causal --seq-len 6
  attnlab example --json > example.json
"""


def add(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("example", help="print the lesson's worked example, step by step, and its parity with torch",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_example_options(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead: keys X, Q, K, V, scores, scores_shifted, weights, "
                        "output (nested lists; -inf as the string \"-Infinity\"), config, max_abs_diff_vs_sdpa")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    config = example_config(args)  # a size past the example's refused before torch is imported
    from attnlab.example import format_example, run_example

    result = run_example(config)
    print(json.dumps(result.to_dict()) if args.json else format_example(result))
    return 0
