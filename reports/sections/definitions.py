"""Definitions: what each number means (docs/metrics.md) and how the statistics are computed."""

from __future__ import annotations

from harness.core.bootstrap import CONFIDENCE, RESAMPLES
from harness.core.stats import PERCENTILE_METHOD, PERCENTILES
from reports import definitions as d
from reports.blocks import Block, Cell, Table
from reports.data import ReportData
from reports.sections.registry import section


def _table(items: list[tuple[str, str]], caption: str, name: str) -> Table:
    return Table(["metric", "definition"], [[Cell(k), Cell(v, cls="wrap")] for k, v in items], caption, name)


def statistics_items() -> list[tuple[str, str]]:
    return [
        ("percentiles", f"p{', p'.join(map(str, PERCENTILES))} and the median (p50) by {PERCENTILE_METHOD}; "
                        f"plus mean, standard deviation (ddof = 1), min, max and the sample count"),
        ("confidence intervals", f"{CONFIDENCE:.0%} percentile-bootstrap intervals of the median "
                                 f"({RESAMPLES} resamples, fixed seed); a throughput's interval "
                                 f"is its latency's, inverted"),
        ("comparisons", "a ratio of medians (current / baseline) with a bootstrap CI, resampling both runs "
                        "independently — not two bare numbers"),
    ]


@section("definitions", "Definitions", "What each number on this page means, and how it was computed.")
def definitions(data: ReportData) -> list[Block]:
    workloads = set(data.rows["workload"].dropna())
    blocks: list[Block] = []
    if workloads & {"sweep", "kv_ablation"} or "prefill_latency_s" in data.rows.columns:
        blocks.append(_table(d.OFFLINE, "Offline (batch) metrics: the prefill/decode split.", "definitions-offline"))
    if "serving" in workloads or "prefix_sharing" in workloads:
        blocks.append(_table(d.SERVING, "Online (serving) metrics, per request. TPOT is averaged per "
                                        "request, ITL per token; they are never relabelled.", "definitions-serving"))
    if "speculative" in workloads:
        blocks.append(_table(d.SPECULATIVE, "Speculative decoding (docs/metrics.md, \"Speculative decoding\").",
                             "definitions-speculative"))
    if "capacity" in workloads or "per_user_tok_s" in data.rows.columns or "load_mode" in data.rows.columns:
        blocks.append(_table(d.CAPACITY, "Load and capacity.", "definitions-capacity"))
    if "tune" in workloads:
        blocks.append(_table(d.TUNING, "Tuning: engines compared at their best.", "definitions-tuning"))
    if "client_limited" in data.rows.columns and data.rows["client_limited"].notna().any():
        blocks.append(_table(d.CLIENT, "The load generator: did it keep up?", "definitions-client"))
    if "transport" in data.rows.columns and (data.rows["transport"] == "http").any():
        blocks.append(_table(d.HTTP, "Engines over HTTP.", "definitions-http"))
    blocks.append(_table(d.MEMORY, "Memory.", "definitions-memory"))
    if "quality" in workloads:
        blocks.append(_table(d.QUALITY, "Quality (teacher-forced, on held-out text).", "definitions-quality"))
    if "energy_j" in data.rows.columns or "energy_note" in data.rows.columns:
        blocks.append(_table(d.ENERGY, "Energy.", "definitions-energy"))
    if "cost_currency" in data.rows.columns and data.rows["cost_currency"].notna().any():
        blocks.append(_table(d.COST, "Cost.", "definitions-cost"))
    blocks.append(_table(statistics_items(), "Statistics.", "definitions-statistics"))
    blocks.append(_table(d.CLOCKS, "Clocks, token counts and repeats.", "definitions-clocks"))
    return blocks
