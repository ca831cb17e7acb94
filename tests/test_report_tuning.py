"""The report's tuning section (reports/sections/tuning.py) on FAKE rows of workload `tune` (hand-made
rows in the schema the workload writes: probe rows, one trial row per trial, one conclusion row per
engine; never measured), and in headless Chromium: the trials table sorts by a click on its header."""

from __future__ import annotations

import html as htmllib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.core.results import make_row, read_rows
from reports import browser, write_report
from reports.data import frame
from reports.sections.tuning import best_pareto_frame, conclusions_frame, importance_frame, trials_frame
from test_report_fakes import capacity_rows, fake_load_point, write_results
from test_report_sections import by_header, figures, notes, page, section_ids, table_headers, table_rows

SLOS = {"ttft_p99_s": 0.5, "tpot_p99_s": 0.05, "e2el_p99_s": None}
REPO = Path(__file__).resolve().parent.parent


def _row(engine: str, point: dict[str, Any], status: str = "ok", error: str | None = None, run_id: str = "fake-tune",
         **fields: Any) -> dict[str, Any]:
    return make_row(engine=engine, workload="tune", status=status, error=error, model="tiny", dtype="float32",
                    device="cpu", run_id=run_id, point=point,
                    point_key="tune:" + json.dumps(point, sort_keys=True, separators=(",", ":"))) | fields


def tune_rows(engine: str, trials: list[tuple[dict[str, Any], float | None, str]], *, best: int | None = None,
              importance: dict[str, float] | None = None, verdict: str = "gain confirmed",
              budget: dict[str, Any] | None = None, ratio: float = 1.2, note: str | None = None,
              resumed_at: int | None = None) -> list[dict[str, Any]]:
    """FAKE tune rows of one engine: per trial (options, capacity in req/s or None, status) two
    probes (one met the SLOs, one did not; the engine ran with the trial's options) and the trial
    row; then the conclusion. Trial 0 is the defaults. `best`: the conclusion's best trial
    (default: the largest capacity). `resumed_at`: trials from this one on were written by a
    second run (+resume=)."""
    rows: list[dict[str, Any]] = []
    for i, (options, cap, status) in enumerate(trials):
        role = "default" if i == 0 else "trial"
        base = {"trial": i, "role": role, "options": options}
        run = {"run_id": "fake-tune-resumed" if resumed_at is not None and i >= resumed_at else "fake-tune"}
        if status == "ok":
            for j, load in enumerate(((cap or 1.0), (cap or 1.0) * 2)):      # met the SLOs (if any did), missed
                _, per_user, device = fake_load_point(load, 1.0 + (cap or 0) / 10)
                meets = j == 0 and cap is not None
                rows.append(_row(engine, base | {"search": "rate", "value": load, "probe": j, "num_requests": 16},
                                 **run, engine_options={"max_num_seqs": 4, **options}, tune_trial=i, tune_role=role,
                                 tune_options=options, meets_slo=meets, slo_violations=[] if meets else ["ttft_p99_s 0.7 > 0.5"], output_tok_s=device, per_user_tok_s=per_user,
                                 ttft_s_p99=0.1, tpot_s_p99=0.01, e2el_s_p99=0.2, saturated=j == 1,
                                 client_limited=False))
        at_best = fake_load_point(cap, 1.0 + cap / 10) if cap is not None else None
        rows.append(_row(engine, base | {"result": True}, status, None if status == "ok" else "out of memory", **run,
                         tune_trial=i, tune_role=role, tune_options=options,
                         tune_value=cap if status == "ok" else None, tune_objective="capacity",
                         capacity_rps=cap if status == "ok" else None,
                         capacity_bracket=[cap, cap * 2] if cap is not None and status == "ok" else None,
                         output_tok_s=at_best[2] if at_best and status == "ok" else None,
                         per_user_tok_s=at_best[1] if at_best and status == "ok" else None,
                         tune_probes=2 if status == "ok" else 0))
    ok = [(i, c) for i, (_, c, s) in enumerate(trials) if s == "ok" and c is not None]
    if best is None:
        best = max(ok, key=lambda t: t[1])[0] if ok else None
    values = dict(ok)
    default = values.get(0)
    rows.append(_row(engine, {"tune": "conclusion"}, tune_objective="capacity", tune_metric="capacity_rps",
                     tune_budget=budget or {"trials": len(trials) - 1, "seed": 0, "sampler": "tpe", "slos": SLOS,
                                            "search": "rate", "space": {o: [1, 2] for t in trials for o in t[0]},
                                            "load": {"num_requests": 16}},
                     tune_trials_run=len(trials), tune_trials_failed=sum(s != "ok" for _, _, s in trials),
                     tune_best_trial=best, tune_best_options=trials[best][0] if best is not None else None,
                     tune_best_value=values.get(best), tune_default_value=default,
                     tune_gain=values[best] / default if best is not None and default else None,
                     tune_confirm={"rounds": 3, "best": [ratio * 2] * 3, "default": [2.0] * 3, "ratio": ratio,
                                   "interval": [ratio - 0.1, ratio + 0.1], "verdict": verdict, "confidence": 0.95},
                     tune_importance=importance, tune_note=note, best_output_tok_s=None, best_per_user_tok_s=None))
    return rows


REF_TRIALS = [({}, 2.0, "ok"), ({"max_num_seqs": 8, "block_size": 16}, 3.0, "ok"),
              ({"max_num_seqs": 64, "block_size": 32}, None, "failed"),
              ({"max_num_seqs": 16, "block_size": 16}, 4.0, "ok"),
              ({"max_num_seqs": 2, "block_size": 32}, None, "ok")]


def reference_rows(**kw: Any) -> list[dict[str, Any]]:
    return tune_rows("reference", REF_TRIALS, importance={"block_size": 0.2, "max_num_seqs": 0.8}, **kw)


# ---- data preparation --------------------------------------------------------------------------

def test_trials_frame_marks_the_conclusions_best_trial_and_failed_trials() -> None:
    tf = trials_frame(frame(reference_rows()))
    assert list(tf["trial"]) == [0, 1, 2, 3, 4]                     # probes and the conclusion are not trials
    assert list(tf["best"]) == [False, False, False, True, False]
    assert list(tf["status"]) == ["ok", "ok", "failed", "ok", "ok"]
    assert tf.loc[2, "value"] is None and tf.loc[2, "error"] == "out of memory"
    assert tf.loc[4, "value"] is None and tf.loc[4, "error"] is None   # ran, nothing met the SLOs
    # the conclusion names the best, not the largest value: the report follows it
    tf = trials_frame(frame(reference_rows(best=1)))
    assert list(tf["best"]) == [False, True, False, False, False]


def test_without_a_conclusion_the_largest_value_is_best() -> None:
    rows = [r for r in reference_rows() if r["point"].get("tune") != "conclusion"]   # a run stopped half-way
    tf = trials_frame(frame(rows))
    assert list(tf.loc[tf["best"], "trial"]) == [3]
    assert conclusions_frame(frame(rows)).empty


def test_importance_is_ordered_largest_first_per_engine() -> None:
    rows = reference_rows() + tune_rows("vllm", [({}, 1.0, "ok"), ({"max_num_batched_tokens": 512}, 1.5, "ok")],
                                        importance={"max_num_batched_tokens": 0.1, "max_num_seqs": 0.6,
                                                    "block_size": 0.3})
    imp = importance_frame(conclusions_frame(frame(rows)))
    assert [(r["engine"], r["option"], r["rank"]) for r in imp.to_dict("records")] == [
        ("reference", "max_num_seqs", 1), ("reference", "block_size", 2),
        ("vllm", "max_num_seqs", 1), ("vllm", "block_size", 2), ("vllm", "max_num_batched_tokens", 3)]


def test_pareto_frame_takes_the_best_and_default_trials_probes_only() -> None:
    df = frame(reference_rows())
    pf = best_pareto_frame(df, conclusions_frame(df))
    assert set(pf["source"].str.split(",").str[0]) == {"trial 3", "trial 0"}
    best = pf[~pf["curve"].str.startswith("capacity")]
    assert best["curve"].iloc[0] == "best configuration (trial 3: max_num_seqs=16 · block_size=16)"
    assert list(best["load"]) == sorted(best["load"])                # drawn in load order
    # the best is the defaults: one curve, said so
    rows = tune_rows("hf", [({}, 5.0, "ok"), ({"max_num_seqs": 4}, 3.0, "ok")])
    pf = best_pareto_frame(frame(rows), conclusions_frame(frame(rows)))
    assert set(pf["curve"]) == {"best = defaults (trial 0)"}


# ---- the page ----------------------------------------------------------------------------------

def test_no_tune_rows_no_section(tmp_path: Path) -> None:
    html = page(tmp_path, capacity_rows("hf"))
    assert "tuning" not in section_ids(html) and "capacity" in section_ids(html)
    assert not re.search(r"<table[^>]* data-sortable", html) and "Sortable tables" not in html   # script with table
    assert table_rows(html, "definitions-tuning") == [] and table_rows(html, "definitions-capacity") != []


def test_section_shows_trials_best_failed_and_conclusion(tmp_path: Path) -> None:
    rows = reference_rows() + tune_rows("vllm", [({}, 1.0, "ok"), ({"max_num_seqs": 32}, 1.5, "ok")],
                                        importance=None, note="fewer than 2 completed trials")
    html = page(tmp_path, rows)
    ids = section_ids(html)
    assert ids.index("summary") < ids.index("tuning") < ids.index("definitions")
    trials = by_header(html, "tuning-trials-reference")
    assert [r["trial"] for r in trials] == ["0", "1", "2", "3", "4"]
    assert [r["max_num_seqs"] for r in trials] == ["(configured)", "8", "64", "16", "2"]
    assert [r["capacity (req/s)"] for r in trials] == ["2.000", "3.000", "failed", "4.000", "none met the SLOs"]
    assert trials[2]["error"] == "out of memory"
    classes = re.findall(r'<tr(?: class="([a-z]+)")?>', html.split('data-table="tuning-trials-reference"')[1]
                                        .split("</table>")[0])
    assert classes[1:] == ["", "", "bad", "good", ""]                # header row first: best green, failed red
    body = html.split('data-table="tuning-trials-reference"')[1].split("<tbody>")[1].split("</tbody>")[0]
    [starred] = [tr for tr in body.split("</tr>") if 'aria-label="best"' in tr]    # one ★, on the best trial
    assert '<tr class="good">' in starred and ">3</td>" in starred
    assert 'data-table="tuning-trials-reference" data-sortable' in html
    assert "option importance" in [r[0] for r in table_rows(html, "definitions-tuning")]
    conc = by_header(html, "tuning-conclusion")
    assert [c["engine"] for c in conc] == ["reference", "vllm"]
    assert conc[0]["best trial"] == "3" and conc[0]["best"] == "4 req/s" and conc[0]["default"] == "2 req/s"
    assert conc[0]["gain (best / default)"] == "2.000" and conc[0]["confirmed ratio [95% interval]"] == "1.200 [1.100–1.300]"
    assert conc[0]["verdict"] == "gain confirmed" and conc[0]["bracket of the best"] == "[4, 8] req/s"
    assert conc[0]["budget"] == "4 trials · seed 0 · TPE · rate search · load num_requests=16"
    [differs] = notes(html, "tuning-budget-differs")                  # 4 trials for one, 1 for the other
    assert differs.split(": ", 1)[1] == "trials: reference 4; vllm 1."    # the spaces differ, as they should
    assert notes(html, "tuning-unconfirmed") == [] and notes(html, "tuning-no-difference") == []
    [missing] = notes(html, "tuning-no-importance")
    assert "vllm (fewer than 2 completed trials)" in missing
    [fig] = figures(html, "tuning-trials")
    names = [t["name"] for t in fig["data"]]
    assert "reference · failed" in names and "reference · none met the SLOs" in names and "vllm · failed" not in names
    failed = next(t for t in fig["data"] if t["name"] == "reference · failed")
    assert failed["x"] == [2] and failed["marker"]["symbol"] == "x"
    star = next(t for t in fig["data"] if t["name"] == "reference · best")
    assert star["x"] == [3] and star["y"] == [4.0]
    imp = by_header(html, "tuning-importance")
    assert [(r["engine"], r["option"]) for r in imp] == [("reference", "max_num_seqs"), ("reference", "block_size")]
    [pareto] = figures(html, "tuning-pareto")
    assert pareto["layout"]["xaxis"]["title"]["text"].startswith("per-user speed")   # the capacity section's axes
    assert {t["name"] for t in pareto["data"]} >= {"vllm · best configuration (trial 1: max_num_seqs=32)"}


def test_unconfirmed_gain_is_a_warning_and_a_red_row(tmp_path: Path) -> None:
    html = page(tmp_path, reference_rows(verdict="best < default", ratio=0.9))
    [warning] = notes(html, "tuning-unconfirmed")
    assert "reference (best < default)" in warning
    assert '<tr class="bad">' in html.split('data-table="tuning-conclusion"')[1].split("</table>")[0]
    html = page(tmp_path, tune_rows("hf", [({}, 1.0, "ok")], verdict="not measured"), name="unmeasured")
    assert "hf (not measured)" in notes(html, "tuning-unconfirmed")[0]
    # within the noise: said, but no warning (best >= default within the interval holds)
    html = page(tmp_path, reference_rows(verdict="no significant difference", ratio=1.0), name="noise")
    assert notes(html, "tuning-unconfirmed") == [] and len(notes(html, "tuning-no-difference")) == 1
    assert '<tr class="bad">' not in html.split('data-table="tuning-conclusion"')[1].split("</table>")[0]


def test_a_resumed_run_stays_one_engine(tmp_path: Path) -> None:
    """A resumed run (another run_id) whose probes ran with each trial's engine options is still one
    engine's tuning, though an option (block_size) differs between the two runs and within neither."""
    trials = [({}, 2.0, "ok"), ({"max_num_seqs": 8, "block_size": 16}, 3.0, "ok"),
              ({"max_num_seqs": 16, "block_size": 16}, 4.0, "ok")]
    html = page(tmp_path, tune_rows("reference", trials, resumed_at=1))
    assert re.findall(r'data-table="(tuning-trials-(?!values)[^"]*)"', html) == ["tuning-trials-reference"]
    assert [r["trial"] for r in by_header(html, "tuning-trials-reference")] == ["0", "1", "2"]
    assert [r["best trial"] for r in by_header(html, "tuning-conclusion")] == ["2"]
    [pareto] = figures(html, "tuning-pareto")                         # the probes of both runs are the engine's
    assert [t["name"] for t in pareto["data"]] == ["reference · best configuration (trial 2: max_num_seqs=16 · "
                                                   "block_size=16)", "reference · capacity probes of the defaults "
                                                   "(trial 0)"]


def test_engines_keep_the_order_of_their_rows(tmp_path: Path) -> None:
    html = page(tmp_path, reference_rows() + tune_rows("hf", [({}, 1.0, "ok"), ({"max_batch_size": 8}, 2.0, "ok")]))
    assert [c["engine"] for c in by_header(html, "tuning-conclusion")] == ["reference", "hf"]
    assert re.findall(r'data-table="(tuning-trials-(?!values)[^"]*)"', html) == ["tuning-trials-reference",
                                                                                 "tuning-trials-hf"]
    [pareto] = figures(html, "tuning-pareto")
    assert [t["name"].split(" ·")[0] for t in pareto["data"]] == ["reference", "reference", "hf", "hf"]


def test_a_repeated_configuration_says_which_trial_it_repeats(tmp_path: Path) -> None:
    rows = reference_rows()
    repeat = next(r for r in rows if r["point"].get("result") and r["point"]["trial"] == 4)
    repeat["point"]["repeat_of"] = 1
    repeat.update(tune_repeat_of=1, tune_options=REF_TRIALS[1][0], tune_value=3.0, capacity_rps=3.0, tune_probes=0)
    trials = by_header(page(tmp_path, rows), "tuning-trials-reference")
    assert [r["role"] for r in trials] == ["default", "trial", "trial", "trial", "trial (repeat of 1)"]
    assert trials[4]["capacity (req/s)"] == "3.000" and trials[4]["probes"] == "0"


def test_nsga2_front_and_goodput_objective(tmp_path: Path) -> None:
    rows = reference_rows()
    for r in rows:
        if r["point"].get("result") or r["point"].get("tune"):
            r["tune_objective"] = "goodput_at_rate"
        if r["point"].get("tune") == "conclusion":
            r.update(tune_metric="goodput_req_s", tune_pareto_trials=[1, 3])
    html = page(tmp_path, rows)
    trials = by_header(html, "tuning-trials-reference")
    assert [r["on the Pareto front"] for r in trials] == ["no", "yes", "no", "yes", "no"]
    assert trials[3]["goodput at the rate (req/s)"] == "4.000"
    [fig] = figures(html, "tuning-trials")
    assert fig["layout"]["yaxis"]["title"]["text"].startswith("goodput at the rate")
    assert "on the Pareto front" not in table_headers(page(tmp_path, reference_rows(), name="tpe"),
                                                      "tuning-trials-reference")


def test_server_trials_show_their_launch_time_and_the_best_launch_command_to_copy(tmp_path: Path) -> None:
    """A launched server's trials (FAKE rows as workload tune writes them for an endpoint): its flags
    are the option columns, each trial its launch-to-ready seconds, a refused flag a red row with
    the server's words; the best configuration's launch command is shown open, as shell lines to
    copy (its options file as a here-document, the environment, the command), the defaults' folded."""
    flags = [({}, 2.0, "ok"), ({"max-num-seqs": 64}, 3.0, "ok"), ({"max-num-seqs": 256}, None, "failed")]
    rows = tune_rows("vllm-serve", flags)
    cmd = {0: "python -m vllm.entrypoints.openai.api_server --port 1234",
           1: "python -m vllm.entrypoints.openai.api_server --port 2345 --max-num-seqs 64 "
              "--extra_llm_api_options /run/x.yaml"}
    for r in rows:
        p = r["point"]
        if p.get("result") and r["status"] == "ok":
            r.update(tune_load_s=12.5 + p["trial"], tune_ready_s=11.0 + p["trial"], tune_launch_command=cmd[p["trial"]])
        if p.get("tune") == "conclusion":
            r.update(tune_best_launch_command=cmd[1], tune_best_launch_env={"VLLM_SERVER_DEV_MODE": "1", "GONE": None},
                     tune_best_server_extra_options={"x.yaml": "max_batch_size: 64\n"},
                     tune_default_launch_command=cmd[0], tune_loads=2, tune_load_s_total=27.0)
    html = page(tmp_path, rows)
    trials = by_header(html, "tuning-trials-vllm-serve")
    assert [r["max-num-seqs"] for r in trials] == ["(configured)", "64", "256"]
    assert [r["launch to ready s"] for r in trials] == ["11.00", "12.00", "–"]
    pres = re.findall(r'<details class="pre"( open)?>\s*<summary>(.*?)</summary>\s*<pre>(.*?)</pre>', html, re.S)
    best = [(o, htmllib.unescape(t)) for o, s_, t in pres if "launch command of the best configuration (trial 1)" in s_]
    assert best and best[0][0] == " open"
    assert best[0][1].splitlines() == ["cat > /run/x.yaml <<'EOF'", "max_batch_size: 64", "EOF",
                                       "env -u GONE VLLM_SERVER_DEV_MODE=1 " + cmd[1]]
    default = [(o, htmllib.unescape(t)) for o, s_, t in pres if "launch command of its defaults" in s_]
    assert default == [("", cmd[0])]
    assert any("2 launches in the run took 27 s" in s_ for _, s_, _ in pres)


def test_every_trial_failed_shows_no_best(tmp_path: Path) -> None:
    rows = tune_rows("reference", [({}, None, "failed"), ({"block_size": 64}, None, "failed")],
                     note="the space admitted nothing")
    html = page(tmp_path, rows)
    conc = by_header(html, "tuning-conclusion")
    assert conc[0]["best trial"] == "–" and conc[0]["best"] == "none" and conc[0]["trials"] == "2 (2 failed)"
    assert "the space admitted nothing" in conc[0]["note"]
    assert [r[-2] for r in table_rows(html, "tuning-trials-reference")] == ["failed", "failed"]
    assert 'aria-label="best"' not in html.split('data-table="tuning-trials-reference"')[1].split("</table>")[0]


# ---- in the browser ----------------------------------------------------------------------------

def drawn_figures(driver: Any) -> list[list[Any]]:
    """[figure name, traces in its data, traces drawn] of every figure of the tuning section."""
    return driver.execute_script("""
        return Array.from(document.querySelectorAll('#tuning figure[data-figure]')).map(f => {
            const el = f.querySelector('.js-plotly-plot');
            return [f.dataset.figure, el && el.data ? el.data.length : 0,
                    el ? el.querySelectorAll('.scatterlayer .trace, .barlayer .trace').length : 0];});""")


@pytest.mark.browser
def test_trials_table_sorts_in_chromium(driver: Any, tmp_path: Path) -> None:
    rows = reference_rows() + tune_rows("vllm", [({}, 1.0, "ok"), ({"max_num_seqs": 32}, 1.5, "ok")],
                                        importance={"max_num_seqs": 1.0})
    write_results(tmp_path / "run", rows)
    report = write_report([tmp_path / "run"], tmp_path / "report.html")
    browser.open_report(driver, report)
    assert [e for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "ERROR")] == []
    drawn = drawn_figures(driver)
    assert [d[0] for d in drawn] == ["tuning-trials", "tuning-importance", "tuning-pareto"]
    assert all(d[1] > 0 and d[2] > 0 for d in drawn), drawn
    capacity_col = driver.execute_script("""
        const t = document.querySelector('table[data-table="tuning-trials-reference"]');
        return Array.from(t.querySelectorAll('thead th')).findIndex(th => th.textContent.startsWith('capacity'));""")
    order = """
        const t = document.querySelector('table[data-table="tuning-trials-reference"]');
        return Array.from(t.tBodies[0].rows).map(r => r.cells[0].textContent.trim());"""
    click = """document.querySelector('table[data-table="tuning-trials-reference"]').querySelectorAll('thead th')
               [arguments[0]].click();"""
    assert driver.execute_script(order) == ["0", "1", "2", "3", "4"]
    driver.execute_script(click, capacity_col)
    assert driver.execute_script(order) == ["3", "1", "0", "2", "4"]        # largest first, no value last
    driver.execute_script(click, capacity_col)
    assert driver.execute_script(order) == ["0", "1", "3", "2", "4"]        # then smallest first


@pytest.mark.heavy  # CI time: the section's rendering is checked on fake rows above and in test_report_browser
@pytest.mark.browser
def test_real_tune_run_report_in_chromium(driver: Any, tmp_path: Path, model_cache: Path) -> None:
    """A small real tuning run of the reference engine (2 trials besides the defaults, 2
    confirmation rounds): its report's tuning section shows every trial row of results.jsonl with
    its value, the conclusion's best trial, and draws its figures."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "harness.cli", "engines=[reference]", "model=tiny", "workload=tune",
           "workload.trials=2", "workload.confirm_rounds=2", "workload.slo_ttft_p99_s=5", "workload.num_requests=8",
           "workload.input_len=16", "workload.output_len=4", "workload.max_probes=3", "quiet=true", "parity=false",
           f"model_cache_dir={model_cache}", f"hydra.run.dir={out}"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = read_rows(out / "results.jsonl")
    trials = [r for r in rows if r["point"].get("result") and r["point"]["role"] in ("default", "trial")]
    [conclusion] = [r for r in rows if r["point"].get("tune") == "conclusion"]
    assert len(trials) == 3

    browser.open_report(driver, out / "report.html")
    assert [e for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "ERROR")] == []
    drawn = drawn_figures(driver)
    expected = ["tuning-trials", *(["tuning-importance"] if conclusion["tune_importance"] else []), "tuning-pareto"]
    assert [d[0] for d in drawn] == expected
    assert all(d[1] > 0 and d[2] > 0 for d in drawn), drawn
    table = driver.execute_script("""
        const t = document.querySelector('table[data-table="tuning-trials-reference"]');
        const heads = Array.from(t.querySelectorAll('thead th')).map(th => th.textContent.trim());
        const col = heads.findIndex(h => h.startsWith('capacity'));
        const read = () => Array.from(t.tBodies[0].rows).map(r => [r.cells[0].textContent.trim(),
            r.cells[col].dataset.value === undefined ? null : parseFloat(r.cells[col].dataset.value),
            r.cells[col].textContent.includes('\u2605')]);
        const before = read();
        t.querySelectorAll('thead th')[col].click();
        return [before, read()];""")
    before, after = table
    assert [(int(t), v) for t, v, _ in before] == [(r["tune_trial"], r["tune_value"]) for r in trials]
    assert [int(t) for t, _, star in before if star] == [conclusion["tune_best_trial"]]
    values = [v for _, v, _ in after if v is not None]
    assert values == sorted(values, reverse=True)                    # sorted by capacity, largest first
    conc = driver.execute_script("""
        const t = document.querySelector('table[data-table="tuning-conclusion"]');
        const heads = Array.from(t.querySelectorAll('thead th')).map(th => th.textContent.trim());
        const cells = Array.from(t.tBodies[0].rows[0].cells).map(c => c.textContent.trim());
        return Object.fromEntries(heads.map((h, i) => [h, cells[i]]));""")
    assert conc["engine"] == "reference" and conc["best trial"] == str(conclusion["tune_best_trial"])
    assert conc["verdict"] == conclusion["tune_confirm"]["verdict"]
