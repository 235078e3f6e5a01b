"""``attnlab masks show``: attention masks printed as matrices."""

from __future__ import annotations

import argparse

from attnlab.cli._args import UsageError, ints, positive_int

HELP = "Print a mask as a matrix: one row per query, one column per key, '#' = attend (True), '.' = masked."
EXAMPLES = ("examples:\n  attnlab masks show causal --L 4 --S 6\n"
            "  attnlab masks show causal --L 4 --S 6 --align bottom_right\n"
            "  attnlab masks show sliding_window --L 6 --S 6 --window 3\n"
            "  attnlab masks show padding --lengths 3,1 --S 4")
MAX_SIDE = 200  # one character per key: wider than a terminal past this


def add(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("masks", help="print attention masks as matrices (# = attend, . = masked)",
                       description=HELP, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p_sub = p.add_subparsers(dest="masks_command", metavar="show")
    show = p_sub.add_parser("show", help="print one mask", description=HELP, epilog=EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    show.add_argument("kind", choices=["causal", "sliding_window", "padding"])
    show.add_argument("--L", type=positive_int, default=4, help="queries (default: 4)")
    show.add_argument("--S", type=positive_int, default=None, help="keys (default: L)")
    show.add_argument("--align", choices=["top_left", "bottom_right"], default="top_left",
                      help="causal alignment (default: top_left, SDPA's is_causal)")
    show.add_argument("--window", type=positive_int, default=2, help="sliding window size (default: 2)")
    show.add_argument("--lengths", type=ints(0), default=[3, 1], help="padding: real lengths (default: 3,1)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from attnlab import masks

    if getattr(args, "masks_command", None) != "show":
        raise UsageError("say what to show: attnlab masks show {causal,sliding_window,padding} [options]; "
                         "see 'attnlab masks --help'")
    S = args.S if args.S is not None else args.L
    if max(args.L, S) > MAX_SIDE or len(args.lengths) > MAX_SIDE:
        raise UsageError(f"--L/--S at most {MAX_SIDE} (one character per key); got L={args.L}, S={S}")
    try:
        if args.kind == "causal":
            m = masks.causal(args.L, S, align=args.align)
            title = f"causal, L={args.L}, S={S}, align={args.align}"
        elif args.kind == "sliding_window":
            m = masks.sliding_window(args.L, S, args.window, align=args.align)
            title = f"sliding_window, L={args.L}, S={S}, window={args.window}, align={args.align}"
        else:
            pad = masks.padding(args.lengths, S)  # (B, 1, 1, S)
            print(f"padding, lengths={args.lengths}, S={S} (one row per sequence)")
            print(masks.render(pad[:, 0, 0, :]))
            return 0
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(title)
    print(masks.render(m))
    return 0
