"""The report's cost: the Cost section (reports/sections/cost.py), the capacity section's cost axis
and the tuning section's cost objective, on FAKE capacity and tune rows (test_report_fakes,
test_report_tuning: never measured) costed by harness.core.cost itself."""

from __future__ import annotations

from pathlib import Path

from harness.core.cost import Price
from reports.blocks import fmt_num
from reports.data import frame
from reports.sections.cost import cost_frame, prices_frame
from reports.sections.tuning import objective_label, trials_frame, unit_of
from test_report_fakes import capacity_rows, priced
from test_report_sections import by_header, figures, notes, page, section_ids, table_headers
from test_report_tuning import reference_rows

CORE = Price(0.05, "core", "USD", "user: cost.price_per_core_hour (our contract)")


def rows(price: Price = CORE) -> list[dict]:
    return priced(capacity_rows("hf") + capacity_rows("reference", speed=1.5, capacity=12,
                                                      probes=((4, True, False), (16, False, True), (12, True, False))),
                  price)


def test_the_cost_section_states_the_price_and_costs_every_priced_point(tmp_path: Path) -> None:
    html = page(tmp_path, rows())
    assert section_ids(html).index("cost") == section_ids(html).index("capacity") + 1
    prices = by_header(html, "cost-prices")
    assert [p["engine"] for p in prices] == ["hf", "reference"]
    assert prices[0]["price used"] == "2 cores × 0.05 USD/core-hour = 0.1 USD/h"
    assert prices[0]["where it comes from"] == "user: cost.price_per_core_hour (our contract)"
    assert prices[0]["per hour"] == "0.1 USD/h"
    costs = by_header(html, "cost")
    assert len(costs) == 7                             # every probe (4 + 3); the conclusions are in the capacity table
    cf = cost_frame(frame(rows()))
    assert set(cf["point_label"]) == {"c=4", "c=8", "c=12", "c=16"}
    missed = cf[cf["point_label"] == "c=16"]
    # a probe that missed its SLOs has half its tokens good: twice the cost per good Mtok (test_report_fakes.priced)
    assert (missed["cost_per_good_mtok_output"] == 2 * missed["cost_per_mtok_output"]).all()
    assert {c["J per output token"] for c in costs} == {"unavailable"}      # no energy in these rows, never 0
    # a point where no request was good: "none good", never a number
    none = priced(capacity_rows("vllm", capacity=None, probes=((4, False, False),)), CORE, good_when_missed=0)
    costs = by_header(page(tmp_path / "none", rows() + none), "cost")
    assert [c["per good Mtok output (USD)"] for c in costs if c["engine"] == "vllm"] == ["none good"]
    assert "definitions-cost" in html


def test_the_capacity_section_has_a_cost_axis_and_the_cost_at_capacity(tmp_path: Path) -> None:
    html = page(tmp_path, rows())
    [fig] = figures(html, "capacity-cost-pareto")
    src = [r for r in rows() if r["engine"] == "hf" and "value" in r["point"]]
    src.sort(key=lambda r: r["point"]["value"])
    trace = next(t for t in fig["data"] if t["name"] == "hf")
    assert trace["x"] == [r["per_user_tok_s"] for r in src]
    assert trace["y"] == [r["cost_per_good_mtok_output"] for r in src]
    assert fig["layout"]["yaxis"]["title"]["text"] == "cost per good Mtok of output (USD)"
    heads = table_headers(html, "capacity")
    assert "cost per good Mtok of output at the capacity" in heads
    cap = {r["engine"]: r for r in by_header(html, "capacity")}
    at = next(r for r in rows() if r["engine"] == "hf" and r["point"].get("result"))
    assert cap["hf"]["cost per good Mtok of output at the capacity"] == f"{fmt_num(at['cost_per_good_mtok_output'])} USD"
    # an engine whose search found no capacity: said so, never a number
    none = priced(capacity_rows("vllm", capacity=None, probes=((4, False, False), (2, False, False))), CORE)
    html = page(tmp_path / "none", rows() + none)
    cap = {r["engine"]: r for r in by_header(html, "capacity")}
    assert cap["vllm"]["cost per good Mtok of output at the capacity"] == "no load met the SLOs"
    assert cap["vllm"]["cheapest probe that met the SLOs"] == "–"


def test_unpriced_rows_show_no_cost_and_unverified_prices_are_warned(tmp_path: Path) -> None:
    html = page(tmp_path / "a", capacity_rows("hf"))
    assert "cost" not in section_ids(html) and not figures(html, "capacity-cost-pareto")
    assert "cost per good Mtok of output at the capacity" not in table_headers(html, "capacity")
    table = Price(0.1785 / 4, "core", "USD", "price table harness/core/prices.yaml: aws-c7i-xlarge, offer aws; "
                                             "NOT VERIFIED: ...")
    warned = page(tmp_path / "b", rows(table))
    assert notes(warned, "cost-unverified")


def test_two_currencies_are_warned_and_never_starred_against_each_other(tmp_path: Path) -> None:
    usd = rows()
    eur = priced(capacity_rows("vllm"), Price(0.04, "core", "EUR", "user: cost.price_per_core_hour"))
    html = page(tmp_path, usd + eur)
    assert notes(html, "cost-currencies")
    pr = prices_frame(frame(usd + eur))
    assert set(pr["currency"]) == {"USD", "EUR"}
    for r in by_header(html, "cost"):
        assert r["per good Mtok output"].endswith((" USD", " EUR")) or r["per good Mtok output"] == "none good"


def test_the_tuning_section_labels_a_cost_objective() -> None:
    assert unit_of("cost_min_per_good_mtok_output", "cost", "USD") == "USD"
    assert objective_label("cost", "USD") == "cost per good Mtok (USD)"
    assert unit_of("capacity_rps", "capacity") == "req/s"
    # without a conclusion, the best trial of a cost is the smallest value
    trial_rows = [r for r in reference_rows() if r["point"].get("tune") != "conclusion"]
    for r in trial_rows:
        if r["point"].get("result"):
            r["tune_objective"] = "cost"
    tf = trials_frame(frame(trial_rows))
    vals = tf[tf["value"].notna()]
    assert list(tf[tf["best"]]["trial"]) == [int(vals.loc[vals["value"].astype(float).idxmin(), "trial"])]
