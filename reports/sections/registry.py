"""The report's sections and their page order. Each section module registers its sections with
`@section(...)` when it is imported; `load_sections()` imports the modules of PAGE_ORDER and
returns their sections in that order (the order of modules, then of registration within one).
This module imports no section, so a section importing it makes no import loop."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from reports.blocks import Block
from reports.data import ReportData

# Page order: the modules of reports/sections/ whose sections the report shows.
PAGE_ORDER = [
    "header", "summary", "baseline", "sweep", "memory", "kv_ablation_section", "prefix", "conversation", "serving_load",
    "speculative", "structured", "reasoning", "lora",
    "capacity",
    "tuning", "cost", "endpoints", "energy", "kv_fragmentation", "roofline_section", "parity_section", "quality", "history_links",
    "definitions",
]


@dataclass
class Section:
    id: str
    title: str
    intro: str
    build: Callable[[ReportData], list[Block]]
    module: str = ""


_REGISTERED: list[Section] = []


def section(id: str, title: str, intro: str = "") -> Callable[[Callable[[ReportData], list[Block]]],
                                                                Callable[[ReportData], list[Block]]]:
    """Register a section (a later one with the same id replaces it)."""
    def register(fn: Callable[[ReportData], list[Block]]) -> Callable[[ReportData], list[Block]]:
        _REGISTERED[:] = [s for s in _REGISTERED if s.id != id]
        _REGISTERED.append(Section(id, title, intro, fn, fn.__module__.rpartition(".")[2]))
        return fn
    return register


def load_sections() -> list[Section]:
    """Every section of the PAGE_ORDER modules, in page order."""
    for name in PAGE_ORDER:
        importlib.import_module(f"reports.sections.{name}")
    rank = {name: i for i, name in enumerate(PAGE_ORDER)}
    return sorted((s for s in _REGISTERED if s.module in rank), key=lambda s: rank[s.module])
