"""`aisrl` command line: `aisrl bench estimator`, `aisrl mismatch` (the mismatch doctor)."""

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


def _mismatch(args) -> int:
    from aisrl.config import apply_overrides
    from aisrl.doctor import DoctorConfig, main

    cfg = DoctorConfig(model=args.model, task=args.task)
    if args.formats:
        cfg.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    apply_overrides(cfg, args.overrides)
    main(cfg, args.out)
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
    mis = sub.add_parser("mismatch", help="the mismatch doctor: rollout-vs-trainer metrics per precision format")
    mis.add_argument("--model", default="smollm2", help="smollm2, a tiny-* model or a local HF directory")
    mis.add_argument("--formats", help="comma-separated presets from aisrl.quant.PRESETS")
    mis.add_argument("--task", default="arithmetic", help="prompt source")
    mis.add_argument("--out", default="runs/mismatch", help="output directory (JSON + PNG)")
    mis.add_argument("overrides", nargs="*", help="e.g. prompts=32 max_new_tokens=128 temperature=0.7")
    mis.set_defaults(func=_mismatch)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad config: one clear line, no traceback
        print(f"aisrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
