"""The roofline section (any workload whose rows carry a roofline fraction): the achieved
fraction of the memory-bandwidth bound (decode) and of the compute bound (prefill)."""

from __future__ import annotations

import pandas as pd

from reports.blocks import Block, Figure, Note, fmt_num
from reports.data import ReportData
from reports.figures import bars, facet_lines
from reports.sections.registry import section
from reports.sections.common import Col, column, facet_if_varies, has, int_columns, point_label, values_table


def roofline_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows with an achieved fraction of the roofline bound (decode: memory bandwidth;
    prefill: compute), any workload."""
    df = rows[rows["status"] == "ok"]
    fields = [f for f in ("decode_bw_fraction", "prefill_compute_fraction") if f in df.columns]
    if not fields:
        return pd.DataFrame()
    df = int_columns(df[df[fields].notna().any(axis=1)])
    if df.empty:
        return df
    df["point_label"] = column(df, "point").map(point_label)
    keep = ["engine", "series", "workload", "point_label", "batch_size", "prompt_len", *fields,
            "decode_roofline_fraction", "decode_roofline_bound", "roofline_mem_bw_bytes_s", "roofline_matmul_flops"]
    return pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)


@section("roofline", "Roofline", "Achieved fraction of the bound that applies: decode by memory bandwidth "
         "(weights + KV read once per step) or, where it takes longer, by its arithmetic (the binding "
         "bound, `decode % of its roofline`), prefill by arithmetic (about 2 × parameters × tokens FLOPs "
         "plus attention), against the ceilings measured at start.")
def roofline(data: ReportData) -> list[Block]:
    df = roofline_frame(data.rows)
    if df.empty:
        return []
    blocks: list[Block] = []
    for field, what, x, facet in (("decode_bw_fraction", "decode: fraction of memory bandwidth", "batch_size", "prompt_len"),
                                  ("prefill_compute_fraction", "prefill: fraction of compute", "prompt_len", "batch_size")):
        d = df.dropna(subset=[field]) if field in df.columns else pd.DataFrame()
        if d.empty:
            continue
        if (d["workload"] == "sweep").any():      # lines over the sweep's grid; other workloads: the table
            d = d[d["workload"] == "sweep"]
            fig = facet_lines(d, x=x, y=field, facet=facet_if_varies(d, facet), colours=data.colours,
                              facet_label=lambda v, f=facet: f"{'prompt length' if f == 'prompt_len' else 'batch size'} {v}",
                              x_title="prompt length (tokens)" if x == "prompt_len" else "batch size",
                              y_title=f"{what} (%)", scale=100)
        else:
            fig = bars(d, x="point_label", y=field, colours=data.colours, x_title="point",
                       y_title=f"{what} (%)", scale=100)
        blocks.append(Figure(fig, f"roofline-{field.split('_')[0]}", f"{what.capitalize()} achieved (100% = the bound)."))
    cols = [Col("engine", "series", text=True), Col("workload", "workload", text=True), Col("point", "point_label", text=True)]
    cols += [Col(h, f, 100, None, "higher") for f, h in (("decode_bw_fraction", "decode % of bandwidth"),
                                                          ("decode_roofline_fraction", "decode % of its roofline"),
                                                          ("prefill_compute_fraction", "prefill % of compute")) if has(df, f)]
    if has(df, "decode_roofline_bound"):
        cols.append(Col("decode bound", "decode_roofline_bound", text=True))
    if blocks:
        blocks[-1].table = values_table(df, cols, "roofline-values", group="point_label")
    bw, flops = column(df, "roofline_mem_bw_bytes_s").dropna(), column(df, "roofline_matmul_flops").dropna()
    if len(bw) or len(flops):
        blocks.insert(0, Note("Ceilings measured on this machine: "
                              + ", ".join(([f"memory bandwidth {fmt_num(bw.iloc[0] / 1e9)} GB/s"] if len(bw) else [])
                                          + ([f"matrix multiply {fmt_num(flops.iloc[0] / 1e9)} GFLOP/s"] if len(flops) else []))
                              + "."))
    return blocks

