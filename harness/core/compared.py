"""What is compared, and how: the one metric table (used by infer-bench-compare,
infer-bench-ab and the report's baseline section) and what each workload is compared on.

Workloads declare their metrics (`workloads.base.Workload.compared_metrics`); each is registered
here when its class is defined. Standard library only: workers import workloads, and this module
with them (the statistics are in harness.core.compare, which only the harness's process runs).
"""

from __future__ import annotations

from typing import NamedTuple


class Metric(NamedTuple):
    """How one metric is compared (by infer-bench-compare and infer-bench-ab alike)."""

    samples: str | None  # the row's repeat samples; None: one value per row (the ratio is its own interval)
    better: str  # lower | higher
    inverse: bool = False  # the samples are of the metric's inverse (a throughput through its latencies)
    median: str | None = None  # the row field of the run's median (infer-bench-ab); None: not A/B-compared
    bracket: str | None = None  # a row field [low, high] bounding a single value (a capacity search's)
    zero_ok: bool = False  # 0 is a real value (a waste share), not a missing one


# The one metric table. Throughputs are compared through the latency samples they are computed
# from (throughput ratio = 1 / latency ratio).
METRICS: dict[str, Metric] = {
    "prefill_latency_s": Metric("prefill_latency_s_samples", "lower", median="prefill_latency_s"),
    "decode_step_latency_s": Metric("decode_step_latency_s_samples", "lower", median="decode_step_latency_s"),
    "e2e_latency_s": Metric("e2e_latency_s_samples", "lower"),
    "output_tok_s": Metric("e2e_latency_s_samples", "higher", inverse=True, median="e2e_latency_s"),
    "ttft_s": Metric("ttft_s_samples", "lower", median="ttft_s"),
    "tpot_s": Metric("tpot_s_samples", "lower", median="tpot_s"),
    "itl_s": Metric("itl_s_samples", "lower"),
    "e2el_s": Metric("e2el_s_samples", "lower", median="e2el_s"),
    "peak_memory_bytes": Metric(None, "lower"),
    # capacity: the highest load that met the SLOs; its interval comes from the search's brackets
    "capacity_rps": Metric(None, "higher", bracket="capacity_bracket"),
    "capacity_concurrency": Metric(None, "higher", bracket="capacity_bracket"),
    # kv_memory: what the cache really takes per token stored, and the share of slots wasted
    "kv_bytes_per_token": Metric(None, "lower"),
    "kv_waste_frac": Metric(None, "lower", zero_ok=True),
    # tune: the best configuration's value (capacity, or goodput at the objective's rate)
    "tune_best_value": Metric(None, "higher"),
}

# What each workload is compared and gated on, declared by the workload itself
# (`Workload.compared_metrics`, registered when its class is defined).
COMPARED_ON: dict[str, tuple[str, ...]] = {}


def register_compared(workload: str, metrics: tuple[str, ...]) -> None:
    """Record what `workload` is compared on (every name must be in METRICS)."""
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"workload {workload}: compared_metrics names {', '.join(unknown)}, not in "
                         f"harness.core.compare.METRICS ({', '.join(METRICS)})")
    COMPARED_ON[workload] = tuple(metrics)


__all__ = ["COMPARED_ON", "METRICS", "Metric", "register_compared"]
