"""``attnlab doctor``: probe a user's attention function and name what is wrong with it."""

from __future__ import annotations

import argparse
import json
import sys

HELP = """\
Call an attention function (torch SDPA's signature: fn(query, key, value, attn_mask=None,
dropout_p=0.0, is_causal=False, scale=None)) on designed inputs, compare it with SDPA and
name the mistake, most likely first, with a hint (docs/mistakes.md lists every code).
--backward runs it backward too and names gradient mistakes; --grad-test takes a gradient
test's loss(out): can that test fail at all? --context-parallel runs a sharded attention
(ring_attention's signature) on --world gloo ranks. It runs your code: only code you trust.

exit status: 0 no problem found, 1 problems found, 2 the function could not be loaded.

examples:
  attnlab doctor mypkg.attention:sdpa
  attnlab doctor attention.py:self_attention --self-attention --json
  attnlab doctor my_kernel.py:flash_attn --backward
  attnlab doctor test_attn.py:loss --grad-test --atol 1e-5 --shape 1,8,1024,64
  attnlab doctor my_cp.py:ring_attn --context-parallel --world 4
"""


def add(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", help="probe your attention function and name what is wrong with it",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="MODULE:FUNCTION",
                   help="the function to check, e.g. mypkg.attn:sdpa or path/to/file.py:my_attention")
    p.add_argument("--self-attention", action="store_true",
                   help="the lab's signature self_attention(X, W_Q, W_K, W_V, mask)")
    p.add_argument("--backward", action="store_true",
                   help="also run the backward and name the gradients' mistakes")
    p.add_argument("--grad-test", action="store_true",
                   help="MODULE:FUNCTION is a gradient test's loss(out): can it fail?")
    p.add_argument("--context-parallel", action="store_true",
                   help="MODULE:FUNCTION is a context-parallel attention")
    p.add_argument("--world", type=int, default=2, help="with --context-parallel: ranks (default: 2)")
    p.add_argument("--atol", type=float, default=1e-5, help="with --grad-test: the test's atol (default: 1e-5)")
    p.add_argument("--rtol", type=float, default=0.0, help="with --grad-test: the test's rtol (default: 0)")
    p.add_argument("--shape", type=_shape, default=(1, 8, 1024, 64), metavar="B,H,L,E",
                   help="with --grad-test: its shape (1,8,1024,64)")
    p.add_argument("--json", action="store_true",
                   help='print {"ok", "max_abs_error", "findings": [{"code", "message"}]}')
    p.set_defaults(func=run)
    return p


def _shape(text: str) -> tuple[int, int, int, int]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1 or shape[2] * shape[2] * shape[0] * shape[1] > 2 ** 27:
        raise argparse.ArgumentTypeError(f"expected B,H,L,E: four positive ints with B*H*L*L at most 2**27, got "
                                         f"{text!r}")
    return shape  # type: ignore[return-value]


def run(args: argparse.Namespace) -> int:
    from attnlab import doctor

    try:
        fn = doctor.load_function(args.target)
    except Exception as exc:  # the user's module may fail to import in any way
        print(f"attnlab doctor: {exc}", file=sys.stderr)
        return 2
    if args.grad_test:
        findings = doctor.audit_gradient_test(fn, args.shape, atol=args.atol, rtol=args.rtol)
        if args.json:
            print(json.dumps({"ok": not findings, "findings": [f.to_dict() for f in findings]}))
        else:
            print("\n".join(f"[{f.code}] {f.message}\n  hint: {doctor.CODES[f.code]}" for f in findings)
                  or f"OK: this test fails on each planted backward mistake at {args.shape}")
        return 1 if findings else 0
    if args.context_parallel:
        from attnlab.distributed.testing import RanksFailed

        if args.world < 2:
            print(f"attnlab doctor: --world must be at least 2, got {args.world}", file=sys.stderr)
            return 2
        try:
            report = doctor.diagnose_context_parallel(args.target, world=args.world)
        except RanksFailed as exc:
            print(f"attnlab doctor: the ranks failed: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(report.to_dict()) if args.json else str(report))
        return 0 if report.ok else 1
    if args.self_attention:
        fn = doctor.adapt_self_attention(fn)
    report = doctor.diagnose_backward(fn) if args.backward else doctor.diagnose(fn)
    print(json.dumps(report.to_dict()) if args.json else str(report))
    return 0 if report.ok else 1
