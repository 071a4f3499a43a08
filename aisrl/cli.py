"""`aisrl` command line. Subcommands grow with the project; today: `aisrl bench estimator`."""

from __future__ import annotations

import argparse
import sys


def _bench_estimator(args) -> int:
    from aisrl.bench.estimator import EstimatorBenchConfig, main
    from aisrl.config import apply_overrides

    cfg = apply_overrides(EstimatorBenchConfig(), args.overrides)
    out = args.out or "runs/estimator/estimator.json"
    main(cfg, out)
    print(f"results: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aisrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark").add_subparsers(dest="bench", required=True)
    est = bench.add_parser(
        "estimator",
        help="exact-gradient MSE of the mismatch corrections on an enumerable policy (DESIGN.md 8.1)",
    )
    est.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. batches=100 seed=1")
    est.add_argument("--out", help="JSON output path (default runs/estimator/estimator.json)")
    est.set_defaults(func=_bench_estimator)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad config: one clear line, no traceback
        print(f"aisrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
