"""What was run, when, on what machine, from which commit, with which config."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from harness.core.results import SCHEMA_VERSION
from reports.blocks import Block, Cell, KeyValues, Note, Pre, Table, fmt_num
from reports.comparison import machine_check
from reports.data import ReportData, RunInfo
from reports.sections.registry import section
from reports.sections.resources import resource_blocks

MAX_CONFIGS = 8


def _gib(v: Any) -> str:
    return f"{v / 2**30:.1f} GiB" if isinstance(v, (int, float)) else "–"


def machine_summary(env: dict[str, Any] | None) -> dict[str, str]:
    """The where-facts of one environment.json, as label -> text."""
    if not env:
        return {}
    cpu = env.get("cpu") or {}
    gpus = env.get("gpus") or []
    gpu_text = "; ".join(f"{g.get('name')} ({_gib(g.get('memory_total_bytes'))}, driver {g.get('driver')})"
                         for g in gpus) or "none"
    packages = env.get("packages") or {}
    git = env.get("git") or {}
    commit = git.get("commit") or "unknown"
    if git.get("dirty"):
        commit += " (uncommitted changes)"
    return {
        "machine": f"{env.get('hostname', '–')} · {cpu.get('model', '–')}, {cpu.get('logical_cores', '–')} logical "
                   f"cores (affinity {cpu.get('affinity', '–')}, torch threads {cpu.get('torch_threads', '–')}) · "
                   f"{_gib(env.get('memory_total_bytes'))} · GPUs: {gpu_text}"
                   + (f" · CUDA {env['cuda']}" if env.get("cuda") else ""),
        "software": f"Python {env.get('python', '–')} · "
                    + (", ".join(f"{k} {v}" for k, v in packages.items()) or "–")
                    + f" · {env.get('platform', '–')}",
        "git commit": commit,
    }


def what_summary(rows: pd.DataFrame) -> dict[str, str]:
    """What was run, from the rows: workloads, models, engines with versions, points, statuses."""
    def uniq(col: str) -> list[str]:
        return [str(v) for v in dict.fromkeys(rows[col].dropna())] if col in rows.columns else []

    engines = []
    for e in uniq("engine"):
        versions = uniq_in(rows[rows["engine"] == e], "engine_version")
        engines.append(f"{e} {', '.join(versions)}".strip())
    counts = rows["status"].value_counts()
    points = rows["point_key"].dropna().nunique()
    return {
        "workloads": ", ".join(uniq("workload")) or "–",
        "model": ", ".join(uniq("model")) or "–",
        "dtype / device": ", ".join(f"{d} / {v}" for d, v in dict.fromkeys(
            zip(rows["dtype"].dropna(), rows["device"].dropna()))) or "–",
        "engines": ", ".join(engines) or "–",
        "points": f"{points} points, {len(rows)} rows ("
                  + ", ".join(f"{n} {s}" for s, n in counts.items()) + ")",
    }


def uniq_in(df: pd.DataFrame, col: str) -> list[str]:
    return [str(v) for v in dict.fromkeys(df[col].dropna())] if col in df.columns else []


def when_summary(rows: pd.DataFrame, runs: list[RunInfo]) -> str:
    stamps = [r.environment.get("timestamp") for r in runs if r.environment and r.environment.get("timestamp")]
    if "timestamp" in rows.columns:
        stamps += [str(t) for t in rows["timestamp"].dropna()]
    stamps = sorted(set(stamps))
    if not stamps:
        return "–"
    return stamps[0] if len(stamps) == 1 else f"{stamps[0]} – {stamps[-1]}"


def _machine_key(env: dict[str, Any] | None) -> tuple:
    m = machine_summary(env)
    return tuple(sorted(m.items()))


@section("run", "Run", "What was run, when, on what machine and resources, and with which configuration.")
def run_header(data: ReportData) -> list[Block]:
    rows, runs = data.rows, data.runs
    items = list(what_summary(rows).items())
    items.append(("when (UTC)", when_summary(rows, runs)))
    envs = [r.environment for r in runs if r.environment]
    machines = {_machine_key(e): e for e in envs}
    if len(machines) == 1:
        items += list(machine_summary(envs[0]).items())
    elif not envs:
        items.append(("machine", "not recorded (no environment.json beside the results)"))
    argvs = list(dict.fromkeys(" ".join(map(str, r.environment.get("argv") or [])) for r in runs
                               if r.environment and r.environment.get("argv")))
    if len(argvs) == 1:
        items.append(("command", argvs[0]))
    items.append(("results", "; ".join(str(r.results) for r in runs)))
    warnings, resources = resource_blocks(rows)
    blocks: list[Block] = [*warnings, KeyValues(items, name="run-facts"), *resources]
    other = sum(r.other_version_rows for r in runs)
    if other:
        blocks.append(Note(f"{other} rows are of another results schema version and are left out; this report "
                           f"reads version {SCHEMA_VERSION} only."))
    if len(machines) > 1:
        labels = list(machine_summary(envs[0]))
        table_rows = []
        for r in runs:
            m = machine_summary(r.environment)
            table_rows.append([Cell(str(r.directory))] + [Cell(m.get(k, "–"), cls="wrap") for k in labels])
        blocks.append(Table(["run"] + labels, table_rows, "The runs ran on different machines or code.",
                            "machines"))
    if len(argvs) > 1:
        blocks.append(Pre(f"commands ({len(argvs)} runs)", "\n".join(argvs)))
    for env in list(machines.values())[:MAX_CONFIGS]:
        blocks.append(Pre("environment.json" + (f" ({env.get('hostname')}, {env.get('timestamp')})"
                                                if len(machines) > 1 else ""),
                          json.dumps(env, indent=2, default=str)))
    configs: dict[str, list[str]] = {}
    for r in runs:
        if r.config_text:
            configs.setdefault(r.config_text, []).append(str(r.directory))
    for i, (text, dirs) in enumerate(configs.items()):
        if i == MAX_CONFIGS:
            blocks.append(Note(f"{len(configs) - MAX_CONFIGS} more distinct configs are not shown; "
                               f"see config.resolved.yaml in each run directory."))
            break
        where = dirs[0] + (f" and {len(dirs) - 1} more" if len(dirs) > 1 else "")
        blocks.append(Pre(f"config ({where})", text))
    if data.baseline is not None:
        check = machine_check(data.baseline_runs, data.baseline, data.runs, data.rows)
        machine = ("same machine" if check.same else "different machines: " + "; ".join(check.differences)
                   if check.same is False else "unknown (no environment.json for the " + " and ".join(check.unknown) + ")")
        blocks.append(KeyValues([("baseline", "; ".join(str(r.results) for r in data.baseline_runs)),
                                 ("baseline machine", machine),
                                 ("baseline when (UTC)", when_summary(data.baseline, data.baseline_runs)),
                                 ("baseline rows", fmt_num(len(data.baseline)))], name="baseline-facts"))
    return blocks
