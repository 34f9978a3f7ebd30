"""The `flashtriton` command: `check` (the notebook's checks), `tune` (forward config sweep), `bench`.

    flashtriton check [--quick] [--out DIR]
    flashtriton tune [--batch 4 --heads 16 --seqlen 4096 --head-dim 128 --causal] [--out DIR]
    flashtriton bench ...            (options: flashtriton bench --help)

Without a CUDA GPU the kernels run through Triton's interpreter, which must be switched on before the
kernels are defined, i.e. before flashtriton is imported. `python -m flashtriton` and the console script both
import flashtriton first, so the command restarts itself once with TRITON_INTERPRET=1 when it has to.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import _env, __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtriton", description="FlashAttention-2 in Triton: checks, "
                                     "tuning and benchmarks (on CPU through Triton's interpreter).")
    parser.add_argument("--version", action="version", version=f"flashtriton {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{check,tune,bench}")
    check = sub.add_parser("check", help="the notebook's checks: accuracy, speed vs naive, memory vs T",
                           description="The cookbook notebook's checks; exit status 1 if any FAILs.")
    tune = sub.add_parser("tune", help="sweep the forward configs of one shape: registers, occupancy, TFLOP/s",
                          description="Compile, check and time every forward config for one shape.")
    # bench's options belong to flashtriton.tools.bench, imported only when it runs: its arguments pass through.
    sub.add_parser("bench", help="side-by-side benchmark (options: flashtriton bench --help)", add_help=False)
    from .tools import checks, tune as tune_mod

    checks.add_arguments(check)
    tune_mod.add_arguments(tune)
    return parser


def _restart_with_interpreter_if_needed(argv) -> None:
    """Without CUDA, re-run this command with TRITON_INTERPRET=1 when the kernels were defined without it."""
    if not _env.enable_interpreter_if_no_cuda() or _env.INTERPRET:
        return
    if argv is not None:  # called from Python: the caller must set the environment before importing flashtriton
        raise SystemExit("flashtriton: no CUDA GPU; set TRITON_INTERPRET=1 before importing flashtriton")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "flashtriton", *sys.argv[1:]])


def _bench(rest: list[str]) -> int:
    try:
        from .tools import bench
    except ModuleNotFoundError as exc:
        if exc.name != "flashtriton.tools.bench":
            raise
        print("flashtriton bench: this installation has no flashtriton.tools.bench module", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="flashtriton bench", description=bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(parser)
    return int(bench.main(parser.parse_args(rest)) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    _restart_with_interpreter_if_needed(argv)
    if args.command == "bench":
        return _bench(rest)
    if args.command == "check":
        from .tools import checks

        return checks.main(args)
    from .tools import tune

    return tune.main(args)
