"""The report's section registry (reports/sections/registry.py): page order from PAGE_ORDER,
whichever section module was imported first, and no section module left off the page."""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys

import reports.sections
from harness.core.paths import REPO_ROOT
from reports.sections.registry import PAGE_ORDER, load_sections


def test_page_order_holds_when_a_later_section_is_imported_first():
    code = ("import reports.sections.definitions, reports.sections.capacity\n"
            "from reports.sections.registry import load_sections\n"
            "print(' '.join(s.module for s in load_sections()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    modules = list(dict.fromkeys(out.stdout.split()))
    assert modules == [m for m in PAGE_ORDER if m in modules]
    assert modules[-1] == "definitions" and modules.index("capacity") > modules.index("header")


def test_every_module_with_a_section_is_on_the_page():
    load_sections()
    folder = REPO_ROOT / "reports" / "sections"
    with_sections = {m.name for m in pkgutil.iter_modules(reports.sections.__path__)
                     if re.search(r"^@section\(", (folder / f"{m.name}.py").read_text(), re.M)}
    assert with_sections == set(PAGE_ORDER)
