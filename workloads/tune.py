"""Tuning: each engine's best configuration under the SLOs, so engines are compared at their best.

For each engine, a sampler (Optuna, ask-and-tell: TPE for one objective, NSGA-II for the front of
throughput against per-user speed) proposes `trials` configurations from the engine's search space
(`space.<engine>.<option>`: a list of choices or {low, high, log}; by default the options the
engine's schema marks with `tune=`, adapters/*/options). Each trial is measured as `capacity`
measures a configuration: the engine is reloaded with the trial's options and a capacity search
(`objective=capacity`) or one fixed-load probe (`objective=goodput_at_rate`: goodput at `rate`)
gives its value. Every engine gets the same budget: the same number of trials, sampler seed, SLOs
and load (the same requests at the same rate, whatever the trial).

The rows, per engine, in order:

1. `default`: the engine's configured options (trial 0), measured like a trial.
2. `trial` 1..N: each probe a row (as capacity's), then one row per trial computed in the harness
   with its value (`tune_value`), options and bracket. A trial whose options cannot run (the
   engine refuses them, runs out of memory) is `failed` and pruned for the sampler; the tuning goes
   on. A configuration the sampler proposes again is not measured twice: its row repeats the
   earlier trial's value (`tune_repeat_of`).
3. `confirm-default` / `confirm-best`, `confirm_rounds` times, interleaved (as infer-bench-ab
   interleaves): the default and the best configuration measured again, one after the other, so
   that the gain is not the noise of one measurement.
4. `conclusion`: best vs default, the confirmation's ratio (geometric mean of the rounds' ratios)
   with its Student-t interval, each option's importance (Optuna's fANOVA evaluator) and the
   budget. A space in which no trial met the SLOs fails the run (exit 1): it admitted nothing.

A launched HTTP endpoint is tuned over its server's own flags (`space.<endpoint>.<flag>`; by
default the flags its kind's record marks, adapters/endpoint/flags.py): each trial relaunches the
server with the trial's flags (they reach it as `engine_options.<endpoint>.server_flags`), its
launch and readiness time is recorded in the trial's row and is no part of any measurement, and
a flag the server refuses at launch makes a failed, pruned trial with the server's own words.
An attached endpoint (a URL) is refused: nothing can restart it. With `endpoints.<name>.dry_run`
every trial fails at once with the command it would have launched, and the conclusion says
"dry run" instead of failing.

The study lives in the run directory (`tune.journal`, Optuna's journal storage), so `+resume=`
continues where a run stopped: trials already asked are reused (never asked twice), and the rows
already written are not measured again. docs/tuning.md says how to read it and why this is not
Hydra's Optuna sweeper.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

try:  # the harness's process runs the sampler and the statistics; an engine's worker in an
    # environment of its own (.venv-vllm) imports this module for run_point only, and need have
    # neither Optuna nor scipy (harness.core.bootstrap)
    import optuna
    from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState

    from harness.core.bootstrap import mean_t_ci
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # TPE's multivariate
except ImportError:  # pragma: no cover - checked in Tune.check
    optuna = None

from adapters.base import Capabilities, Engine
from harness.core.schema import check, spec, tune_space
from harness.core.shell import launch_script
from workloads.base import Point, RunContext
from workloads.capacity import (Capacity, CapacityConfig, bracket, capacity_cost, next_value, probe_outcomes,
                                round_load, slo_violations)

WORKLOAD = "tune"
OBJECTIVES = ("capacity", "goodput_at_rate", "cost")
SEARCHED = ("capacity", "cost")  # the objectives whose trials are capacity searches (goodput_at_rate: one probe)
SAMPLERS = ("tpe", "nsga2", "random")
JOURNAL = "tune.journal"
SEARCH_ROLES = ("default", "trial")
CONFIRM_ROLES = ("confirm-default", "confirm-best")
SERVER_FLAGS = "server_flags"  # the endpoint option a trial's flags go in (adapters/endpoint/options.py)
DRY_RUN = "(dry run, nothing started)"  # what a dry-run endpoint's load fails with (adapters/endpoint/engine.py)
VERDICTS = ("gain confirmed", "no significant difference", "best < default", "not measured")


@dataclass
class TuneConfig(CapacityConfig):
    name: str = spec(WORKLOAD)
    trials: int = spec(12, ge=1, help="configurations tried per engine (the same budget for every engine), "
                                      "besides the default")
    objective: str = spec("capacity", choices=OBJECTIVES,
                          help="capacity: a capacity search per trial | goodput_at_rate: one probe at `rate`, "
                               "its goodput (requests/s within the SLOs) | cost: a capacity search per trial, "
                               "minimising the cost per good million output tokens over its probes that met "
                               "the SLOs (needs a price: cost.*)")
    rate: float | None = spec(None, gt=0, help="objective=goodput_at_rate: the probe's request rate (search=rate) "
                                               "or concurrency (search=concurrency)")
    sampler: str = spec("tpe", choices=SAMPLERS, help="tpe: one objective | nsga2: the Pareto front of output "
                                                      "tokens/s against tokens/s per user | random")
    sampler_seed: int = spec(0, ge=0, help="the sampler's seed (the same for every engine)")
    space: dict[str, Any] = spec({}, help="per engine: {option: [choices] | {low, high, log}}; an engine not "
                                          "named searches its default space (the options its schema marks)")
    confirm_rounds: int = spec(3, ge=0, help="interleaved rounds of default and best measured again at the end "
                                             "(0: no confirmation; 2 or more give an interval)")
    max_probes: int = spec(8, ge=2, help="most probes per capacity search")


# ---- the space --------------------------------------------------------------------------------
def distribution(values: Any, where: str) -> tuple[BaseDistribution | None, list[str]]:
    """An Optuna distribution from a space entry ([choices] or {low, high, log, step})."""
    if isinstance(values, (list, tuple)):
        if not values:
            return None, [f"{where}=[]: the list of choices is empty. Give at least one value."]
        bad = [v for v in values if not (v is None or isinstance(v, (bool, int, float, str)))]
        if bad:
            return None, [f"{where}: choices must be numbers, strings, true/false or null, not {bad[0]!r}."]
        return CategoricalDistribution(list(dict.fromkeys(values))), []
    if isinstance(values, dict):
        unknown = sorted(set(values) - {"low", "high", "log", "step"})
        if unknown or "low" not in values or "high" not in values:
            return None, [f"{where}={values}: give a list of choices or {{low: .., high: .., log: true|false}}"
                          + (f" (unknown keys: {', '.join(unknown)})" if unknown else "") + "."]
        low, high, log, step = values["low"], values["high"], bool(values.get("log", False)), values.get("step")
        nums = [v for v in (low, high, step) if v is not None]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in nums):
            return None, [f"{where}: low, high and step must be numbers."]
        if low > high:
            return None, [f"{where}: low={low} is above high={high}."]
        if log and low <= 0:
            return None, [f"{where}: log=true needs low > 0 (low={low})."]
        try:
            if all(isinstance(v, int) for v in nums):
                return IntDistribution(int(low), int(high), log=log, step=int(step or 1)), []
            return FloatDistribution(float(low), float(high), log=log, step=step), []
        except ValueError as e:
            return None, [f"{where}: {e}"]
    return None, [f"{where}={values!r}: give a list of choices or {{low: .., high: .., log: true|false}}."]


def _ends(dist: BaseDistribution) -> list[Any]:
    """The values of a distribution that bound it (each is checked against the option's schema)."""
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    return [dist.low, dist.high]  # type: ignore[attr-defined]


def value_problems(values: Any, where: str, check_one: Any) -> list[str]:
    """A space entry's problems: its shape (`distribution`), then each value bounding it checked
    by `check_one(value) -> [problem]` (the option's schema, a server flag's bounds)."""
    dist, problems = distribution(values, where)
    return problems if dist is None else problems + [p for v in _ends(dist) for p in check_one(v)]


def flatten(space: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A space whose keys Hydra nested at their dots (kv_cache_config.tokens_per_block) as flat
    dotted keys; a {low, high, ...} range is a value, not a level."""
    out: dict[str, Any] = {}
    for k, v in space.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and not set(v) <= {"low", "high", "log", "step"}:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def flag_space(name: str, flags: dict[str, Any], given: dict[str, Any] | None,
               version: str | None) -> tuple[dict[str, Any], list[str]]:
    """A launched server's space over its own flags (`flags`: {name: ServerFlag}, from its
    kind's record): as given, else the flags the record marks; problems name
    `workload.space.<endpoint>.<flag>`."""
    where = f"workload.space.{name}"
    space = flatten(dict(given)) if given is not None else {f: d.tune for f, d in flags.items() if d.tune is not None}
    if not space:
        return {}, [f"{where}: the space is empty: {name}'s record marks no flag to tune by default. Give some, e.g. "
                    f"+{where}.<flag>=[a,b]; its flags: {', '.join(flags)}."]
    problems = []
    for flag, values in space.items():
        if flag not in flags:
            problems.append(f"{where}.{flag}: {name}'s server has no flag {flag!r} the harness knows (a flag is "
                            f"named as the server spells it, without its dashes). Its flags: {', '.join(flags)}.")
            continue
        problems += value_problems(values, f"{where}.{flag}",
                                   lambda v, f=flags[flag]: f.problems(v, f"{where}.{f.name}", version))
    return space, problems


def engine_space(name: str, cls: type[Engine], given: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The space an engine is searched over (as given, else its schema's default) and the problems
    with it, each naming `workload.space.<engine>.<option>`; a launched server's space is over
    its own flags (`cls.tuning_flags()`)."""
    where = f"workload.space.{name}"
    if cls.options_cls is None:  # a launched server (adapters/endpoint/checks.py): its own flags
        flags, why = cls.tuning_flags()
        if why:
            return {}, [f"{where if given is not None else 'workload=tune'}: {why}"]
        return flag_space(name, flags, given, cls.declared_version())
    space = dict(given) if given is not None else tune_space(cls.options_cls)
    if not space:
        return {}, [f"{where}: the space is empty: {name} marks no option to tune by default. Give some, e.g. "
                    f"+{where}.<option>=[a,b]; its options: {', '.join(f.name for f in fields(cls.options_cls))}."]
    problems = []
    known = {f.name for f in fields(cls.options_cls)}
    for option, values in space.items():
        if option not in known:
            problems.append(f"{where}.{option}: {name} has no option {option!r}. Its options: {', '.join(sorted(known))}.")
            continue
        problems += value_problems(values, f"{where}.{option}",
                                   lambda v, o=option: check(cls.options_cls, {o: v}, where)[1])
    return space, problems


def distributions(space: dict[str, Any]) -> dict[str, BaseDistribution]:
    out = {}
    for option, values in space.items():
        dist, _ = distribution(values, option)
        if dist is not None:
            out[option] = dist
    return out


# ---- rows of one search -----------------------------------------------------------------------
def launch_fields(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """What loading the trial's configuration cost and, for a launched server, what it ran: from
    the probe that loaded it (the first of the search). tune_load_s: the engine's load (a server:
    stop the previous one, start, wait until ready, identify), tune_ready_s: a server's start to
    readiness; neither is in any measurement."""
    first = next((r for r in probes if isinstance(r.get("load_time_s"), (int, float))), None)
    out: dict[str, Any] = {}
    if first is None:
        return out
    info = first.get("engine_info") if isinstance(first.get("engine_info"), dict) else {}
    out["tune_load_s"] = first["load_time_s"]
    if info.get("server_ready_s") is not None:
        out["tune_ready_s"] = info["server_ready_s"]
    if first.get("launch_command"):
        out["tune_launch_command"] = first["launch_command"]
        out["tune_launch_env"] = info.get("launch_env")
        out["tune_server_extra_options"] = first.get("server_extra_options")
    return out



def _same_search(p: dict[str, Any], q: dict[str, Any]) -> bool:
    return all(p.get(k) == q.get(k) for k in ("role", "trial", "round"))


def _search_rows(rows: list[dict[str, Any]], engine: str, p: dict[str, Any]) -> list[dict[str, Any]]:
    """The probe rows of the search (role, trial, round) that `p` belongs to, in order."""
    return [r for r in rows if r.get("engine") == engine and r.get("workload") == WORKLOAD
            and "value" in (r.get("point") or {}) and _same_search(r["point"], p)]


def _results(rows: list[dict[str, Any]], engine: str, roles: tuple[str, ...]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("engine") == engine and r.get("workload") == WORKLOAD
            and (r.get("point") or {}).get("result") and r["point"].get("role") in roles]


def lower_is_better(objective: str | None) -> bool:
    """The objective's direction: a cost is minimised, a capacity or a goodput maximised."""
    return objective == "cost"


def best_result(rows: list[dict[str, Any]], engine: str) -> dict[str, Any] | None:
    """The default or trial row with the highest value (the earliest of equals), or None when no
    configuration met the SLOs."""
    good = [r for r in _results(rows, engine, SEARCH_ROLES) if r.get("status") == "ok" and r.get("tune_value")]
    sign = -1 if any(lower_is_better(r.get("tune_objective")) for r in good) else 1
    return max(good, key=lambda r: (sign * r["tune_value"], -r["point"]["trial"]), default=None)


def _load_found(row: dict[str, Any], cfg: TuneConfig) -> float | None:
    """The load a search found (its capacity), where the next search of the same options starts."""
    return row.get("capacity_rps" if cfg.search == "rate" else "capacity_concurrency")


def confirm_ratio(pairs: list[tuple[float | None, float | None]], confidence: float = 0.95,
                  lower_better: bool = False) -> dict[str, Any]:
    """How many times better best is than default over interleaved rounds (default, best):
    best/default (a cost, `lower_better`: default/best, how many times cheaper), the geometric
    mean of the rounds' ratios, its Student-t interval, and the verdict. A round where either
    side met nothing is left out and said."""
    usable = [(d, b) for d, b in pairs if d and b]
    out: dict[str, Any] = {"rounds": len(pairs), "default": [d for d, _ in pairs], "best": [b for _, b in pairs],
                           "ratio": None, "interval": None, "verdict": "not measured", "confidence": confidence}
    if len(usable) < len(pairs):
        out["note"] = (f"{len(pairs) - len(usable)} of {len(pairs)} rounds had a side that met no SLO "
                       "(no capacity to divide)")
    if not usable:
        return out
    logs = np.log([d / b if lower_better else b / d for d, b in usable])
    out["ratio"] = float(math.exp(logs.mean()))
    ci = mean_t_ci(logs, confidence)
    if ci is None:
        out["note"] = ((out.get("note") or "") + "; " if out.get("note") else "") + "one round: no interval"
        return out
    lo, hi = math.exp(ci[0]), math.exp(ci[1])
    out["interval"] = [lo, hi]
    out["verdict"] = "gain confirmed" if lo > 1 else "best < default" if hi < 1 else "no significant difference"
    return out


class Tune(Capacity):
    name = WORKLOAD
    compared_metrics = ("tune_best_value",)
    config_cls = TuneConfig
    summary_columns = [
        ("tune_role", "role", "s"), ("tune_trial", "trial", "d"), ("tune_options", "options", "s"),
        ("tune_value", "value", "g"), ("capacity_bracket", "bracket", "s"), ("output_tok_s", "out tok/s", ".1f"),
        ("per_user_tok_s", "tok/s/user", ".1f"), ("tune_probes", "probes", "d"), ("tune_load_s", "load s", ".1f"),
    ]

    def __init__(self) -> None:
        self.run_dir: Path | None = None
        self._studies: dict[str, Any] = {}

    # ---- configuration ------------------------------------------------------------------
    def check(self, cfg: TuneConfig, shape: Any) -> list[str]:
        problems = []
        if optuna is None:
            problems.append("workload=tune needs Optuna in the harness's environment: pip install 'optuna>=4' "
                            "(make venv installs it).")
        if cfg.objective == "goodput_at_rate" and cfg.rate is None:
            problems.append("workload.rate: objective=goodput_at_rate measures goodput at one load; give it, "
                            "e.g. workload.rate=4.")
        if cfg.sampler == "nsga2" and cfg.objective != "capacity":
            problems.append("workload.sampler=nsga2 searches the front of throughput against per-user speed at "
                            "capacity; use objective=capacity.")
        return problems + super().check(cfg, shape)

    def needs_price(self, cfg: TuneConfig) -> str | None:
        return "workload.objective=cost" if cfg.objective == "cost" else None

    def check_engines(self, cfg: TuneConfig, engines: dict[str, type[Engine]]) -> list[str]:
        problems = [f"workload.space.{name}: {name} is not one of this run's engines ({', '.join(engines)})."
                    for name in cfg.space if name not in engines]
        resolved = {}
        for name, cls in engines.items():
            resolved[name], probs = engine_space(name, cls, cfg.space.get(name))
            problems += probs
        if not problems:
            cfg.space = resolved  # every engine's space, defaults filled in: rows and the report state it
        return problems

    def bind_run_dir(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def plan(self, cfg: TuneConfig) -> list[Point]:
        return [self._first_probe(cfg, "default", 0, {}, None)]

    def _start(self, cfg: TuneConfig, start: float | None) -> float:
        if cfg.objective == "goodput_at_rate":
            return float(cfg.rate)  # type: ignore[arg-type]
        return start or cfg.start

    def _first_probe(self, cfg: TuneConfig, role: str, trial: int, options: dict[str, Any],
                     round_: int | None, start: float | None = None) -> Point:
        value = self._start(cfg, start)
        params = {"role": role, "trial": trial, "options": options, "search": cfg.search,
                  "value": round_load(value, cfg.search),
                  "probe": 0, "num_requests": cfg.num_requests}
        if round_ is not None:
            params["round"] = round_
        return Point(self.name, params)

    def _result(self, role: str, trial: int, options: dict[str, Any], round_: int | None,
                **extra: Any) -> Point:
        params = {"role": role, "trial": trial, "options": options, "result": True, **extra}
        if round_ is not None:
            params["round"] = round_
        return Point(self.name, params)

    # ---- in the engine's process --------------------------------------------------------
    def engine_overrides(self, point: Point, caps: Capabilities) -> dict[str, Any]:
        options = dict(point.params.get("options") or {})
        if caps is not None and SERVER_FLAGS in caps.options:  # a launched server: relaunched with the flags
            return {SERVER_FLAGS: options} if options else {}
        return options

    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: TuneConfig,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        p = point.params
        value = p["value"]
        load = {"concurrency": int(value)} if cfg.search == "concurrency" else {"request_rate": value}
        # the same requests for every trial and engine at this load: the key leaves the options out
        key = f"{self.name}:{cfg.search}={value:g}/n={p['num_requests']}"
        row = self.measure(engine, cfg, ctx, {**load, "num_requests": p["num_requests"]}, key)
        why = slo_violations(row, cfg.slos())
        row.update(capacity_search=cfg.search, value=value, meets_slo=not why, slo_violations=why,
                   capacity_slo=cfg.slos(), tune_trial=p["trial"], tune_role=p["role"], tune_options=p["options"])
        return row

    # ---- the search, in the harness's process -------------------------------------------
    def _study(self, engine: str, cfg: TuneConfig) -> Any:
        if engine not in self._studies:
            if self.run_dir is None:
                raise RuntimeError("workload=tune: the run directory is not bound (Runner binds it)")
            storage = JournalStorage(JournalFileBackend(str(self.run_dir / JOURNAL)))
            if cfg.sampler == "nsga2":
                sampler = optuna.samplers.NSGAIISampler(
                    seed=cfg.sampler_seed, population_size=max(4, min(50, cfg.trials // 2)))
            elif cfg.sampler == "random":
                sampler = optuna.samplers.RandomSampler(seed=cfg.sampler_seed)
            else:  # a third of the budget explores at random, then TPE models what it found
                sampler = optuna.samplers.TPESampler(seed=cfg.sampler_seed, multivariate=True,
                                                     n_startup_trials=max(2, min(10, cfg.trials // 3)))
            directions = (["maximize", "maximize"] if cfg.sampler == "nsga2" else
                          ["minimize"] if lower_is_better(cfg.objective) else ["maximize"])
            self._studies[engine] = optuna.create_study(study_name=engine, storage=storage, sampler=sampler,
                                                        directions=directions, load_if_exists=True)
        return self._studies[engine]

    def _trial_options(self, engine: str, cfg: TuneConfig, trial: int) -> dict[str, Any]:
        """Trial `trial`'s options (1-based): the study's trial `trial - 1` when it was asked
        before (a resumed run), else a new one asked now."""
        study = self._study(engine, cfg)
        asked = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
        if len(asked) >= trial:
            return dict(asked[trial - 1].params)
        return dict(study.ask(fixed_distributions=distributions(cfg.space.get(engine) or {})).params)

    def _tell(self, engine: str, cfg: TuneConfig, row: dict[str, Any]) -> None:
        study = self._study(engine, cfg)
        trial = row["point"]["trial"]
        asked = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
        if len(asked) < trial or asked[trial - 1].state != TrialState.RUNNING:
            return  # told before this run was resumed
        number = asked[trial - 1].number
        if row.get("status") != "ok" or (lower_is_better(cfg.objective) and not row.get("tune_value")):
            study.tell(number, state=TrialState.PRUNED)  # a cost with nothing meeting the SLOs: no value at all
        elif cfg.sampler == "nsga2":
            study.tell(number, [row.get("output_tok_s") or 0.0, row.get("per_user_tok_s") or 0.0])
        else:
            study.tell(number, row.get("tune_value") or 0.0)  # nothing met the SLOs: a capacity of 0

    def next_points(self, point: Point, row: dict[str, Any], rows: list[dict[str, Any]],
                    cfg: TuneConfig) -> list[Point]:
        p, engine = point.params, row["engine"]
        if p.get("tune"):
            return []
        if "value" in p:  # a probe: the next of its search, or the search's result
            if cfg.objective in SEARCHED and row.get("status") == "ok":
                nxt = next_value(probe_outcomes(_search_rows(rows, engine, p)), cfg)
                if nxt is not None:
                    return [Point(self.name, {**p, "value": nxt, "probe": p["probe"] + 1})]
            return [self._result(p["role"], p["trial"], p["options"], p.get("round"))]
        return self._after_search(p, row, rows, cfg, engine)

    def _after_search(self, p: dict[str, Any], row: dict[str, Any], rows: list[dict[str, Any]],
                      cfg: TuneConfig, engine: str) -> list[Point]:
        if p["role"] == "trial":
            self._tell(engine, cfg, row)
        if p["role"] in SEARCH_ROLES and p["trial"] < cfg.trials:
            return [self._trial_point(engine, cfg, p["trial"] + 1, rows)]
        sequence = self._confirm_sequence(rows, engine, cfg)
        here = (p["role"], p.get("round")) if p["role"] in CONFIRM_ROLES else None
        i = sequence.index(here) + 1 if here in sequence else 0
        if i < len(sequence):
            role, round_ = sequence[i]
            best = best_result(rows, engine)
            assert best is not None
            src = best if role == "confirm-best" else next(r for r in _results(rows, engine, ("default",)))
            return [self._first_probe(cfg, role, src["point"]["trial"], src["point"]["options"], round_,
                                      start=_load_found(src, cfg))]
        return [Point(self.name, {"tune": "conclusion"})]

    def _trial_point(self, engine: str, cfg: TuneConfig, trial: int, rows: list[dict[str, Any]]) -> Point:
        options = self._trial_options(engine, cfg, trial)
        earlier = next((r for r in _results(rows, engine, ("trial",)) if r["point"]["trial"] < trial
                        and r["point"]["options"] == options and r["point"].get("repeat_of") is None), None)
        if earlier is not None:  # proposed again: its measurement stands
            return self._result("trial", trial, options, None, repeat_of=earlier["point"]["trial"])
        default = next((r for r in _results(rows, engine, ("default",))), None)
        return self._first_probe(cfg, "trial", trial, options, None,
                                 start=_load_found(default, cfg) if default else None)

    def _confirm_sequence(self, rows: list[dict[str, Any]], engine: str,
                          cfg: TuneConfig) -> list[tuple[str, int]]:
        if best_result(rows, engine) is None:
            return []
        return [(role, r) for r in range(cfg.confirm_rounds) for role in CONFIRM_ROLES]

    def compute_in_harness(self, point: Point, engine: str, rows: list[dict[str, Any]],
                           cfg: TuneConfig) -> dict[str, Any] | None:
        p = point.params
        if p.get("tune") == "conclusion":
            return self._conclusion(engine, rows, cfg)
        if not p.get("result"):
            return None
        head = {"tune_trial": p["trial"], "tune_role": p["role"], "tune_options": p["options"],
                "tune_objective": cfg.objective}
        if p.get("repeat_of") is not None:
            earlier = next(r for r in _results(rows, engine, ("trial",))
                           if r["point"]["trial"] == p["repeat_of"] and not r["point"].get("repeat_of"))
            copy = {k: v for k, v in earlier.items() if k.startswith(("tune_value", "capacity_", "output_tok_s",
                                                                       "per_user_tok_s", "cost_"))}
            status = {"status": earlier["status"], "error": earlier.get("error")} if earlier["status"] != "ok" else {}
            return {**copy, **head, **status, "tune_repeat_of": p["repeat_of"], "tune_probes": 0}
        probes = _search_rows(rows, engine, p)
        ran = [r for r in probes if r.get("status") == "ok"]
        head.update(launch_fields(probes))
        if not ran:
            why = next((r.get("error") for r in probes if r.get("error")), None) or "no probe ran"
            return {**head, "status": "failed", "error": f"the trial's options could not run: {why}",
                    "tune_value": None, "tune_probes": len(probes)}
        lo, hi = bracket(probe_outcomes(probes))
        top = next((r for r in ran if r.get("meets_slo") and r["point"]["value"] == lo), None)
        key = "capacity_rps" if cfg.search == "rate" else "capacity_concurrency"
        cost = capacity_cost(ran, lo)
        value = (lo if cfg.objective == "capacity" else cost.get("cost_min_per_good_mtok_output")
                 if cfg.objective == "cost" else (ran[-1].get("goodput_req_s") or 0.0))
        return {**head, "tune_value": value, key: lo, "capacity_bracket": [lo, hi], "capacity_slo": cfg.slos(),
                "output_tok_s": top.get("output_tok_s") if top else None,
                "per_user_tok_s": top.get("per_user_tok_s") if top else None, "tune_probes": len(probes), **cost}

    def _conclusion(self, engine: str, rows: list[dict[str, Any]], cfg: TuneConfig) -> dict[str, Any]:
        trials = _results(rows, engine, ("trial",))
        default = next((r for r in _results(rows, engine, ("default",))), None)
        best = best_result(rows, engine)
        rounds: dict[int, dict[str, float | None]] = {}
        for r in _results(rows, engine, CONFIRM_ROLES):
            rounds.setdefault(r["point"]["round"], {})[r["point"]["role"]] = (
                r.get("tune_value") if r.get("status") == "ok" else None)
        pairs = [(v.get("confirm-default"), v.get("confirm-best")) for _, v in sorted(rounds.items())]
        default_value = default.get("tune_value") if default else None
        searches = [r for r in rows if r.get("engine") == engine and r.get("workload") == WORKLOAD
                    and "value" in (r.get("point") or {})]
        loads = [r["load_time_s"] for r in searches if isinstance(r.get("load_time_s"), (int, float))]
        out: dict[str, Any] = {
            "tune_objective": cfg.objective, "tune_metric": ("capacity_rps" if cfg.search == "rate" else
                                                             "capacity_concurrency") if cfg.objective == "capacity"
            else "cost_min_per_good_mtok_output" if cfg.objective == "cost" else "goodput_req_s",
            "tune_budget": {"trials": cfg.trials, "seed": cfg.sampler_seed, "sampler": cfg.sampler,
                            "slos": cfg.slos(), "search": cfg.search, "space": cfg.space.get(engine),
                            "load": {"num_requests": cfg.num_requests, "input_len": cfg.input_len,
                                     "output_len": cfg.output_len, "arrival": cfg.arrival,
                                     "max_probes": cfg.max_probes, "resolution": cfg.resolution}},
            "tune_trials_run": len(trials), "tune_trials_failed": sum(r.get("status") != "ok" for r in trials),
            "tune_best_trial": best["point"]["trial"] if best else None,
            "tune_best_options": best["point"]["options"] if best else None,
            "tune_best_value": best.get("tune_value") if best else None,
            "tune_default_value": default_value,
            "tune_gain": ((default_value / best["tune_value"]) if lower_is_better(cfg.objective) else
                          (best["tune_value"] / default_value)) if best and default_value else None,
            "best_output_tok_s": best.get("output_tok_s") if best else None,
            "best_per_user_tok_s": best.get("per_user_tok_s") if best else None,
            "tune_confirm": confirm_ratio(pairs, lower_better=lower_is_better(cfg.objective)) if pairs else
            {"rounds": 0, "verdict": "not measured", "ratio": None, "interval": None},
            "tune_importance": None, "tune_note": None,
            # (re)loads of the engine (launches of a server) and their time, none of it measured
            "tune_loads": len(loads), "tune_load_s_total": sum(loads) if loads else None,
        }
        for key, row in (("best", best), ("default", default)):  # a launched server's command, copyable
            if row is not None and row.get("tune_launch_command"):
                out[f"tune_{key}_launch_command"] = row["tune_launch_command"]
                out[f"tune_{key}_launch_env"] = row.get("tune_launch_env")
                out[f"tune_{key}_server_extra_options"] = row.get("tune_server_extra_options")
        notes = []
        try:
            study = self._study(engine, cfg)
            done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
            if len({tuple(sorted(t.params.items())) for t in done}) >= 2:
                target = (lambda t: t.values[0]) if cfg.sampler == "nsga2" else None
                out["tune_importance"] = {k: float(v) for k, v in
                                          optuna.importance.get_param_importances(study, target=target).items()}
            else:
                notes.append("too few distinct completed trials for option importances")
            if cfg.sampler == "nsga2":
                out["tune_pareto_trials"] = sorted(t.number + 1 for t in study.best_trials)
        except (RuntimeError, ValueError) as e:
            notes.append(f"option importances not computed ({e})")
        good_trials = [r for r in trials if r.get("status") == "ok" and r.get("tune_value")]
        searched = trials + ([default] if default else [])
        if searched and all(DRY_RUN in str(r.get("error") or "") for r in searched):
            why = (f"dry run (endpoints.{engine}.dry_run=true): nothing was started; the command each trial would "
                   "have launched is in its row's error")
            return {**out, "tune_note": why, "status": "skipped", "error": why}
        if not good_trials:
            failed = out["tune_trials_failed"]
            why = (f"the space admitted nothing: none of the {len(trials)} trials met the SLOs "
                   f"({failed} failed to run, {len(trials) - failed} met no probed load)")
            return {**out, "tune_note": "; ".join([why] + notes), "status": "failed", "error": why}
        out["tune_note"] = "; ".join(notes) or None
        return out

    # ---- verdicts ----------------------------------------------------------------------
    def expected_failure(self, row: dict[str, Any]) -> bool:
        """A trial's options that cannot run are a pruned trial, not a failure of the run (the
        conclusion fails when no trial ran); a dry-run endpoint's points fail by design."""
        return (row.get("point") or {}).get("role") == "trial" or DRY_RUN in str(row.get("error") or "")

    def summary(self, rows: list[dict[str, Any]]) -> str:
        """One line per trial (its probes are in the results), then best vs default per engine."""
        return super().summary([r for r in rows if r.get("workload") != self.name or "value" not in (r.get("point") or {})
                                or r.get("status") != "ok"])

    def post_summary(self, rows: list[dict[str, Any]]) -> str:
        lines = []
        for r in rows:
            if r.get("workload") != self.name or not (r.get("point") or {}).get("tune"):
                continue
            c = r.get("tune_confirm") or {}
            ratio = f"x{c['ratio']:.3f}" if c.get("ratio") else "-"
            ci = c.get("interval")
            ci_text = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""

            def num(v: Any) -> str:
                return "-" if v is None else f"{v:g}"
            lines.append(f"tune      {r['engine']:<9} best {num(r.get('tune_best_value'))} "
                         f"(trial {r.get('tune_best_trial')}: {r.get('tune_best_options')}) vs default "
                         f"{num(r.get('tune_default_value'))}; confirmed {ratio}{ci_text} over {c.get('rounds', 0)} "
                         f"rounds: {c.get('verdict')}; {r.get('tune_trials_run')} trials, "
                         f"{r.get('tune_trials_failed')} failed")
            if r.get("tune_importance"):
                imp = ", ".join(f"{k} {v:.2f}" for k, v in r["tune_importance"].items())
                lines.append(f"          {r['engine']:<9} importance: {imp}")
            if c.get("note"):
                lines.append(f"          {r['engine']:<9} confirmation: {c['note']}")
            if r.get("tune_note"):
                lines.append(f"          {r['engine']:<9} {r['tune_note']}")
            if r.get("tune_loads"):
                server = r.get("tune_best_launch_command") or r.get("tune_default_launch_command")
                what = "server launches (start to ready)" if server else "engine loads"
                lines.append(f"          {r['engine']:<9} {r['tune_loads']} {what} took "
                             f"{r.get('tune_load_s_total') or 0:.1f} s, outside every measurement")
            if r.get("tune_best_launch_command"):
                lines.append(f"          {r['engine']:<9} best configuration's launch command:\n"
                             + launch_script(r.get("tune_best_launch_command"), r.get("tune_best_launch_env"),
                                             r.get("tune_best_server_extra_options"), indent="            "))
        for r in rows:  # a dry run: what each trial would have launched
            if (r.get("workload") == self.name and (r.get("point") or {}).get("result")
                    and DRY_RUN in str(r.get("error") or "")):
                p = r["point"]
                lines.append(f"dry run   {r['engine']:<9} {p['role']} {p['trial']} {p['options'] or ''}: "
                             + str(r["error"]).split(DRY_RUN, 1)[1].lstrip(": "))
        return "\n".join(lines)
