"""The energy section: joules per output token where the row measured energy (NVML on a
GPU, RAPL on a CPU), and why it is absent where it is not (the row's `energy_note`)."""

from __future__ import annotations

import pandas as pd

from reports.blocks import Block, Note
from reports.data import ReportData
from reports.sections.common import Col, column, int_columns, point_label, present, values_table
from reports.sections.registry import section

ENERGY_FIELDS = ("energy_j", "joules_per_output_token", "output_tokens_per_joule", "energy_source", "energy_note")


def energy_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Ok rows that measured energy: series, workload, point, J, J per output token, output
    tokens per J, source."""
    if "energy_j" not in rows.columns and "joules_per_output_token" not in rows.columns:
        return pd.DataFrame()
    ok = rows[rows["status"] == "ok"]
    measured = ok[column(ok, "energy_j").map(present) | column(ok, "joules_per_output_token").map(present)]
    if measured.empty:
        return pd.DataFrame()
    df = int_columns(measured)
    df = df.assign(point_label=column(df, "point").map(point_label))
    keep = ["engine", "series", "workload", "point_label", "point_key", "energy_j", "joules_per_output_token",
            "output_tokens_per_joule", "energy_source"]
    return pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)


def energy_absent(rows: pd.DataFrame) -> pd.DataFrame:
    """Per series and reason: the ok rows without an energy figure, and why (`energy_note`)."""
    if "energy_note" not in rows.columns:
        return pd.DataFrame()
    ok = rows[(rows["status"] == "ok") & ~column(rows, "energy_j").map(present)
              & ~column(rows, "joules_per_output_token").map(present) & column(rows, "energy_note").map(present)]
    out = [{"series": s, "note": n, "rows": len(g)} for (s, n), g in ok.groupby(["series", "energy_note"], sort=False)]
    return pd.DataFrame(out)


@section("energy", "Energy", "Energy the device used while each point ran (NVML on a GPU, RAPL on a "
         "CPU), per output token and its inverse; where a row has none, the reason it gives.")
def energy(data: ReportData) -> list[Block]:
    df = energy_frame(data.rows)
    absent = energy_absent(data.rows)
    if df.empty and absent.empty:
        return []
    blocks: list[Block] = []
    if not df.empty:
        blocks.append(values_table(df, [
            Col("engine", "series", text=True), Col("workload", "workload", text=True),
            Col("point", "point_label", text=True), Col("energy J", "energy_j"),
            Col("J per output token", "joules_per_output_token", 1, None, "lower"),
            Col("output tokens per J", "output_tokens_per_joule", 1, None, "higher"),
            Col("source", "energy_source", text=True)], "energy",
            "★: the least energy per token among engines at the same point.", group="point_key"))
    if not absent.empty:
        blocks.append(Note("No energy figure for " + "; ".join(
            f"{r.series} ({r.rows} row{'s' if r.rows != 1 else ''}): {r.note}" for r in absent.itertuples()) + ".",
            name="energy-absent"))
    return blocks
