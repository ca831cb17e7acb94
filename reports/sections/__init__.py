"""The report's sections, in page order. Each section is one function: data prep in pandas
(a separate, unit-tested function) → tables and figures. A section returns no blocks when its
data is absent, and is then left out of the page.

Adding a section for a new workload takes a few lines:

    @section("my-workload", "My workload", "what it shows")
    def my_workload(data: ReportData) -> list[Block]:
        df = my_prep(data.workload("my_workload"))
        if df.empty:
            return []
        return [Figure(facet_lines(df, ...), "my-figure", table=values_table(df, ...))]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from reports.blocks import Block
from reports.data import ReportData


@dataclass
class Section:
    id: str
    title: str
    intro: str
    build: Callable[[ReportData], list[Block]]


SECTIONS: list[Section] = []


def section(id: str, title: str, intro: str = "") -> Callable[[Callable[[ReportData], list[Block]]],
                                                                Callable[[ReportData], list[Block]]]:
    """Register a section; page order is registration order (module import order below)."""
    def register(fn: Callable[[ReportData], list[Block]]) -> Callable[[ReportData], list[Block]]:
        SECTIONS[:] = [s for s in SECTIONS if s.id != id]
        SECTIONS.append(Section(id, title, intro, fn))
        return fn
    return register


# Page order.
from reports.sections import (  # noqa: E402,F401
    header, summary, baseline, sweep, memory, kv_ablation_section, prefix, serving_load, capacity, endpoints,
    energy, kv_fragmentation, roofline_section, parity_section, quality, history_links, definitions)
