"""The report's LoRA section (reports/sections/lora.py): its data preparation on rows the LoRA code
itself completes (workloads/lora.py traffic_fields and finalize) from FAKE request traces (a
stand-in for an engine's timings, engines named fake-*), and the section's tables on the page."""

from __future__ import annotations

from typing import Any

from harness.core.metrics import RequestTrace
from harness.core.results import make_row
from reports.data import add_series
from reports.sections.lora import check_frame, per_adapter_frame, split_frame, swap_frame
from test_report_sections import page, table_rows
from workloads import lora
from adapters.base import Request

import pandas as pd

POINT = {"adapters": {"a0": "/fake/a0", "a1": "/fake/a1"}, "split": "round_robin", "base_share": 0.0,
         "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 2}


def fake_row(engine: str, point_lora: dict[str, Any], concurrency: int, ttft_ms: list[float],
             check: dict[str, Any] | None = None, stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """A row as a LoRA serving point writes it, from FAKE traces: request i arrives at 0 and gets 4
    tokens, its first after ttft_ms[i]."""
    reqs = [Request(f"r{i}", [1, 2, 3], 4) for i in range(len(ttft_ms))]
    for r, a in zip(reqs, lora.assignment(point_lora, len(reqs), 0, "fake")):
        r.adapter = a
    traces = [RequestTrace(r.request_id, 0, 3, token_times_ns=[int(t * 1e6) + k * 1_000_000 for k in range(4)],
                           token_ids=[7, 8, 9, 10]) for r, t in zip(reqs, ttft_ms)]
    expected = {r.request_id: 4 for r in reqs}
    fields = lora.traffic_fields(point_lora, reqs, traces, expected, {"loads": 0, "evictions": 0}, stats)
    point = {"concurrency": concurrency, "num_requests": len(reqs), "lora": point_lora}
    row = make_row(run_id="fake", timestamp="2026-01-01T00:00:00+00:00", engine=engine, engine_version="0-fake",
                   model="tiny-trained", workload="serving", point=point, point_key=f"serving:{point}", status="ok",
                   dtype="float32", device="cpu", ttft_s=sorted(ttft_ms)[len(ttft_ms) // 2] / 1e3, **fields,
                   **({"lora_check": check} if check else {}))
    return row


def fake_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    mismatch = {"request": "r1", "adapter": "a1", "position": 2, "expected": 9, "got": 5, "base_alone": 5}
    for engine, check in (("fake-a", {"verdict": "pass", "compared": 8, "detail": "8 requests equal", "mismatch": None}),
                          ("fake-b", {"verdict": "fail", "compared": 8, "detail": "request r1 (adapter a1) ...",
                                      "mismatch": mismatch})):
        row = fake_row(engine, POINT, 4, [10, 20, 30, 40, 11, 21, 31, 41], check)
        lora.finalize(row, rows)
        rows.append(row)
    for n, ttft in ((1, [10.0] * 6), (2, [25.0] * 6)):
        pl = {"adapters": {f"a{i}": f"/fake/a{i}" for i in range(n)}, "split": "round_robin", "base_share": 0.0,
              "swap": n, "max_loras": 1, "max_lora_rank": 8, "max_cpu_loras": n}
        row = fake_row("fake-a", pl, 1, ttft, stats={"loads": 6 if n > 1 else 1, "evictions": 5 if n > 1 else 0})
        lora.finalize(row, rows)
        rows.append(row)
    return rows


def test_frames_per_adapter_split_check_and_swap():
    df = add_series(pd.DataFrame(fake_rows()))
    per = per_adapter_frame(df)
    assert set(per["adapter"]) == {"a0", "a1"} and set(per["series"]) == {"fake-a", "fake-b"}
    assert per[(per["series"] == "fake-a") & (per["adapter"] == "a0")]["sent"].iloc[0] == 4
    split = split_frame(df)
    assert (split["test"] == "exact").all() and (split["ok"] == "yes").all()
    checks = check_frame(df)
    bad = checks[checks["series"] == "fake-b"].iloc[0]
    assert bad["verdict"] == "fail" and bad["first"] == "r1 (a1): token 2 5, alone 9"
    swap = swap_frame(df)
    assert list(swap["adapters_n"]) == [1, 2]
    two = swap[swap["adapters_n"] == 2].iloc[0]
    assert abs(two["swap_cost_s"] - 0.015) < 1e-9 and two["loads"] == 6 and two["evictions"] == 5


def test_section_tables_on_the_page(tmp_path):
    html = page(tmp_path, fake_rows())
    assert '<section id="lora"' in html
    per = table_rows(html, "lora-per-adapter")
    assert len(per) == 4 and per[0][:3] == ["fake-a", "concurrency 4", "a0"]
    assert any(r[0] == "fake-b" and r[2] == "fail" and "r1 (a1)" in r[4] for r in table_rows(html, "lora-check"))
    swap = table_rows(html, "lora-swap")
    assert [r[1] for r in swap] == ["1", "2"] and swap[1][3].startswith("15")
