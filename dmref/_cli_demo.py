"""``dmref demo``: every preset recipe on a realistic attention problem (CPU), as a table, a
PNG plot and, with ``--json``, a list of objects."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run every preset recipe on a realistic attention problem; table, JSON, PNG",
        description="Row-sum residual of dS, output and gradient errors and dQ bias fraction of "
                    "every preset recipe against the float64 reference, on a problem with "
                    "outlier channels, a sink key and peaked attention rows.",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of objects instead of the table")
    p.add_argument("--out", default="dmref_demo.png", help="PNG path (default dmref_demo.png; '' for none)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seqlen", "-n", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--no-causal", action="store_true", help="full attention instead of causal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipes", nargs="*", default=None, metavar="NAME",
                   help="preset names (default: all); NAME@hopper for the Hopper accumulation model")
    p.add_argument("--sweep", nargs="*", type=int, default=None, metavar="N",
                   help="sequence lengths of the error-vs-length sweep (default 128 256 512 1024; "
                        "give none to skip it)")
    p.add_argument("--sweep-heads", type=int, default=None, help="heads of the sweep's problems (default: --heads)")
    p.add_argument("--draws", type=int, default=256, metavar="T",
                   help="largest number of roundings dQ's error is averaged over (default 256; 0 skips it)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from dmref.demo import main

    return main(args)
