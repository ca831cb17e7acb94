"""`infer-bench-report RESULTS... -o report.html [--baseline B...]`

RESULTS: results.jsonl files or run directories (single runs and multiruns; every
results.jsonl below a directory is read). Exit codes: 0 written, 2 unusable input (one
message, no traceback).
"""

from __future__ import annotations

import argparse
import sys

from harness.core.errors import EXIT_BAD_INPUT, EXIT_OK, UserError
from harness.core.compare import parse_threshold
from reports.data import ReportInputError
from reports.render import write_report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer-bench-report",
        description="Render the HTML comparison report (self-contained, works offline) of one or "
                    "more infer-bench results files or run directories.")
    p.add_argument("results", nargs="+", metavar="RESULTS",
                   help="results.jsonl files or run directories (single runs or multiruns)")
    p.add_argument("-o", "--output", default="report.html", metavar="FILE",
                   help="where to write the page (default: report.html)")
    p.add_argument("--baseline", nargs="+", metavar="B", default=None,
                   help="results files or run directories to compare against: adds the ratio "
                        "current / baseline per metric with its 95%% CI")
    p.add_argument("--threshold", default="5%", metavar="PCT",
                   help="with --baseline: the smallest change that counts, as infer-bench-compare's "
                        "--threshold (default 5%%)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        threshold = parse_threshold(args.threshold)
        path = write_report(args.results, args.output, baseline=args.baseline, threshold=threshold)
    except ReportInputError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    except UserError as e:   # from the threshold's parser
        print(e.render("infer-bench-report"), file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(f"infer-bench-report: error: -o {args.output}: cannot write ({e.strerror or e}).", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"report: {path}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
