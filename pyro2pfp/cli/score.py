"""``pyro2pfp score``: score input shards with an exported network on Ray Data (a local Ray instance,
or a cluster), one Parquet file per shard (:func:`pyro2pfp.runtime.ray_scoring.score_files`)."""
from __future__ import annotations

import argparse
import sys

from ..runtime.ray_scoring import score_files
from .files import CLIError


def cmd_score(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401 -- score_files imports it when it runs; say here what is missing
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != "ray":
            raise
        raise CLIError("pyro2pfp score runs on Ray Data, which is not installed: pip install 'pyro2pfp[ray]' "
                       "(or 'ray[data]')") from None
    report = score_files([args.model, *(args.library or [])], args.inputs, args.output, workers=args.workers,
                         cpus_per_worker=args.cpus_per_worker, batch_size=args.batch_size,
                         rows_per_block=args.rows_per_block, column=args.column, metrics=args.metrics,
                         num_samples=args.samples, seed=args.seed, ray_address=args.ray_address,
                         progress=not args.quiet)
    rate = f", {report.rows / report.seconds:,.0f} rows/s" if report.seconds > 0 and report.rows else ""
    print(f"scored {report.rows:,} rows into {len(report.written)} file(s) in {args.output} in "
          f"{report.seconds:.1f} s{rate} ({report.workers} worker(s), {report.cpus_per_worker:g} CPU each)")
    if report.skipped:
        print(f"skipped {len(report.skipped)} shard(s) whose output exists (delete it to score the shard again)")
    for message in report.failed.values():
        print(f"failed: {message}", file=sys.stderr)
    return 1 if report.failed else 0
