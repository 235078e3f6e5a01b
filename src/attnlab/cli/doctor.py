"""``attnlab doctor``: probe a user's attention function and name what is wrong with it."""

from __future__ import annotations

import argparse
import json
import sys

HELP = """\
Call an attention function on designed inputs (unequal sizes, large scores, bool and
float masks, causal with L != S, fully masked rows, dropout) and compare it with
torch's SDPA. When it is wrong, name the mistake, most likely first, with a hint:

  missing_scale  wrong_scale  unstable_softmax  softmax_dim  wrong_transpose
  value_swapped  mask_polarity  mask_after_softmax  causal_alignment
  fully_masked_nan  dropout_scale  shape_error  unknown

The function must take torch SDPA's signature:
  fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None)
(or the lab's self_attention signature, with --self-attention).
It runs in this process: only check code you trust (graders use 'attnlab grade').

exit status: 0 no problem found, 1 problems found, 2 the function could not be loaded.

examples:
  attnlab doctor mypkg.attention:sdpa
  attnlab doctor my_attention.py:attention
  attnlab doctor attention.py:self_attention --self-attention --json
"""


def add(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", help="probe your attention function and name what is wrong with it",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="MODULE:FUNCTION",
                   help="the function to check, e.g. mypkg.attn:sdpa or path/to/file.py:my_attention")
    p.add_argument("--self-attention", action="store_true",
                   help="the function has the lab's signature self_attention(X, W_Q, W_K, W_V, mask=None)")
    p.add_argument("--json", action="store_true",
                   help='print {"ok": ..., "max_abs_error": ..., "findings": [{"code": ..., "message": ...}]}')
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from attnlab import doctor

    try:
        fn = doctor.load_function(args.target)
    except Exception as exc:  # the user's module may fail to import in any way
        print(f"attnlab doctor: {exc}", file=sys.stderr)
        return 2
    if args.self_attention:
        fn = doctor.adapt_self_attention(fn)
    report = doctor.diagnose(fn)
    print(json.dumps(report.to_dict()) if args.json else str(report))
    return 0 if report.ok else 1
