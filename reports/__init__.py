"""The HTML comparison report: one self-contained page (Plotly's JavaScript embedded once, no
network) that shows engines side by side. `write_report` is what `infer-bench` calls after
every run; `infer-bench-report` (reports.cli) is the command line."""

from __future__ import annotations

from reports.data import ReportInputError
from reports.render import render_report, write_report

__all__ = ["ReportInputError", "render_report", "write_report"]
