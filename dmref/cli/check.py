"""``dmref check package.module:function``: run the oracle on an attention implementation.

Exit status: 0 when every check passed (cases of an optional feature fn cannot do are reported
UNSUPPORTED and do not count unless ``--require``d), 1 when a check failed or a case timed out
(``--timeout SECONDS``, per case), 2 when the command cannot run: the target cannot be imported,
is not callable or has the wrong signature, the device is not available, an option is invalid
(one line on stderr says which), 3 when no check failed but one was INCONCLUSIVE (the probe could
not vouch for its reading of the row sums; the report says what it read). The terminal report
(the verdict line first, one row per case, fitting 80 columns; ``--wide``: every check's
statistic) goes to stdout, the progress to stderr; with ``--json`` stdout holds only the report
as strict JSON.
"""

from __future__ import annotations

import importlib
import os
import sys

EXIT_PASSED, EXIT_FAILED, EXIT_USAGE, EXIT_INCONCLUSIVE = 0, 1, 2, 3
#: the exit status of each verdict (dmref.oracle.OracleReport.verdict)
EXIT_STATUS = {"PASSED": EXIT_PASSED, "FAILED": EXIT_FAILED, "INCONCLUSIVE": EXIT_INCONCLUSIVE}

_DTYPES = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32", "fp64", "float64")  # oracle.DTYPE_NAMES


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="run the oracle on an attention implementation package.module:function",
        description="Run fn(q, k, v, *, causal, scale[, mask]) -> out forward and backward on the oracle's "
                    "cases and compare against the float64 reference (dmref.oracle.check). Exit status 0 "
                    "only when every check passes; 1 when one fails; 2 when fn cannot be imported or "
                    "called; 3 when none failed but one was inconclusive (the probe could not vouch for "
                    "its reading).",
    )
    p.add_argument("target", help="package.module:function (the module must be importable; the current "
                                  "directory is on the path)")
    p.add_argument("--recipe", default=None, metavar="R",
                   help="the recipe fn implements (a dmref preset, e.g. naive_fp8, delta_matching@hopper); "
                        "default: exact attention at the input dtype's bounds")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="input dtype (default bf16)")
    p.add_argument("--cases", default="standard", choices=("quick", "standard", "thorough"),
                   help="case set (default standard, as dmref.oracle.check and the pytest fixture)")
    p.add_argument("--case", action="append", default=None, metavar="NAME",
                   help="run only this case of the set (repeatable, each case at most once)")
    p.add_argument("--head-dim", type=int, default=None, metavar="D",
                   help="run every case at head dim D (even, >= 16; Q, K and V alike); default each case's own: 64, "
                        "96 (other_head_dim), 256 (single_kv_head), 192 and 128 for V (mla_head_dims)")
    p.add_argument("--require", action="append", default=[], choices=("gqa", "mask", "window", "documents"),
                   help="an optional feature fn must do (repeatable): its cases fail instead of being reported "
                        "UNSUPPORTED when fn raises")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="limit per case (fn's calls and the oracle's work on it), finite, at most "
                        "threading.TIMEOUT_MAX; a case that takes longer fails and the remaining cases are not run")
    p.add_argument("--causal-alignment", default=None, choices=("top_left", "bottom_right"),
                   help="how fn aligns a causal mask when seqlen_q != seqlen_k: top_left (SDPA's is_causal: query i "
                        "sees keys j <= i) or bottom_right (FlashAttention >= 2.1: j <= i + seqlen_k - seqlen_q); "
                        "default: fn's attribute causal_alignment if it has one, else inferred from the cases where "
                        "the two differ (and named in the verdict line)")
    p.add_argument("--device", default="cpu", help="device fn runs on (default cpu); it must hold data that "
                                                  "can be read back (not meta)")
    p.add_argument("--seed", type=int, default=0, help="seed of the cases' inputs, in [0, (2^64 - 1000) / 1000]")
    p.add_argument("--no-probe", action="store_true", help="skip the row-sum probe (one fn call per case)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--wide", action="store_true",
                   help="the full table: every check's statistic / bound, one column per check (about 160 "
                        "columns); default: one row per case, fitting 80")
    p.set_defaults(func=_run)


def load_target(spec: str):
    """The callable named by ``package.module:function`` (``function`` may be dotted:
    ``module:Class.method``). Raises ValueError with a message naming what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"target {spec!r} must look like package.module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"cannot import module {module_name!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - report whatever the user's module raised on import
        raise ValueError(f"importing module {module_name!r} raised {type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
        except Exception as e:  # noqa: BLE001 - e.g. a module __getattr__ rejecting the name
            raise ValueError(f"{module_name}:{attr}: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise ValueError(f"{module_name}:{attr} is a {type(obj).__name__}, not a function")
    return obj


def _run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    try:
        fn = load_target(args.target)
        from dmref import oracle
        from dmref.recipes import get_recipe

        oracle.validate_signature(fn)
        if args.recipe is not None:
            get_recipe(args.recipe)
        problem = oracle.device_problem(args.device)
        if problem:
            raise ValueError("--" + problem)
        try:
            oracle.check_timeout(args.timeout)
        except ValueError as e:
            raise ValueError(f"--timeout {args.timeout:g}: {e}") from None
        try:
            oracle.check_seed(args.seed)
        except ValueError as e:
            raise ValueError(f"--seed {args.seed}: {e}") from None
        dtype = oracle.resolve_dtype(args.dtype)
        cases = oracle.make_cases(args.cases, dtype=dtype, seed=args.seed, names=args.case, probe=not args.no_probe,
                                  head_dim=args.head_dim)
    except (ValueError, TypeError) as e:
        print(f"dmref check: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task("oracle", total=len(cases))

        def step(name, index, total):
            progress.update(task, completed=index, description=f"case {name}")

        try:
            report = oracle.check(fn, recipe=args.recipe, cases=cases, dtype=dtype, device=args.device,
                                  probe=not args.no_probe, progress=step, target=args.target,
                                  require=args.require, timeout=args.timeout,
                                  causal_alignment=args.causal_alignment)
        except oracle.TargetUnavailable as e:
            progress.stop()
            print(f"dmref check: error: {args.target} cannot run here: {' '.join(str(e).split())}",
                  file=sys.stderr)
            return EXIT_USAGE
        progress.update(task, completed=len(cases))

    if args.json:
        print(report.to_json(indent=1))
    else:
        report.render(Console(), wide=args.wide)
    code = EXIT_STATUS[report.verdict]
    if args.timeout is not None and any(c.detail.startswith("timed out") for c in report.failed):
        err.print(report.summary())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # a timed-out case may still be running in a thread that cannot be stopped
    return code
