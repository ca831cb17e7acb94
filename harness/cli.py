"""`infer-bench`: the Hydra app.

    infer-bench [overrides]          one run
    infer-bench -m [sweep overrides] a multirun (Hydra's sweeper; one job per combination)

Before Hydra runs anything, every job's config is composed and checked; bad input ends with
one message per problem, each naming the field and the fix, and exit code 2. Exit codes:
0 success, 1 a run finished but some point failed, 2 unusable input (nothing run), 130 Ctrl-C.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from harness.checkpoint import cached_path, ensure_checkpoint, shipped_checkpoint, shipped_mismatch
from harness.config import build_plan, compose_job  # noqa: F401 (compose_job re-exported)
from harness.core.env import environment
from harness.core.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_POINT_FAILED, UserError
from harness.core.hub import check_repo_id, hub_shorthands, register_hub_shorthands  # noqa: F401 (re-exported)
from harness.core.paths import CONF_DIR, model_cache_dir
from harness.core.presets import load_preset, preset_names, prompt_token_range, shape_from_hf_config
from harness.core.redact import redact_text
from harness.core.results import CONFIG_FILE, ENVIRONMENT_FILE, RESULTS_FILE, atomic_write_text, read_rows
from harness.locks import lock_device, lock_run_dir
from harness.outcome import EXIT, record_exit, write_job_exit, write_run_report
from harness.runner import Runner
from adapters import engine_names
from workloads import workload_names

EXIT_INTERRUPTED = 130
PARITY_MODEL = "tiny-trained"  # workload=parity's model where none is named, when its checkpoint is at hand

_INFO_FLAGS = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i",
               "--shell-completion", "-sc", "--resolve", "-p", "--package"}
_ARG_FLAGS = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
              "--experimental-rerun"}


# ---- checking every job before anything runs ------------------------------------------------

def _split_argv(argv: list[str]) -> tuple[bool, list[str], bool]:
    """(multirun, overrides, check_possible)."""
    multirun, overrides, checkable = False, [], True
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("-m", "--multirun"):
            multirun = True
        elif a in _INFO_FLAGS or a.split("=")[0] in _INFO_FLAGS:
            checkable = False
        elif a in _ARG_FLAGS:
            checkable, skip = False, True
        elif a.startswith("-"):
            checkable = False
        else:
            overrides.append(a)
    return multirun, overrides, checkable


# Open mappings: settings whose keys the user names (an endpoint and its options; where an engine's
# worker runs). Hydra would want `+` to add such a key; these overrides get `++` (add or replace).
_OPEN_KEYS = re.compile(r"^(endpoints\.[^=]+|engine_options\.[^.=]+\.(python|launch)|cost\.engines\.[^=]+)=")
_ENGINE_OPTION = re.compile(r"^engine_options\.([^.=]+)\.[^=]+=")


def open_mappings(argv: list[str]) -> list[str]:
    """The command line with `++` before every override of an open mapping (an endpoint's
    options included: engine_options.<endpoint>.<option>; an engine's prices: cost.engines.<engine>.<key>)."""
    out = []
    for a in argv:
        m = _ENGINE_OPTION.match(a)
        if _OPEN_KEYS.match(a) or (m and m.group(1) not in engine_names()):
            a = "++" + a
        out.append(a)
    return out


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Every job of a basic-sweeper multirun (the cartesian product of comma/range sweeps). Hydra's
    basic sweeper is private API (hydra._internal): used here only, and tests/test_cli_private_api.py
    fails loudly if it moves."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # private: contained here
    parsed = OverridesParser.create().parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for batch in batches for job in batch]


def _hydra_problem(e: Exception, overrides: list[str]) -> str:
    """Hydra's composition errors, rephrased to name the field and the fix."""
    msg = str(e).strip()
    for group, names, what in (("model", preset_names(), "model preset"),
                               ("workload", workload_names(), "workload")):
        if f"'{group}/" in msg and ("Could not find" in msg or "Could not load" in msg):
            given = next((o.split("=", 1)[1] for o in overrides if o.startswith(f"{group}=")), "?")
            if group == "model" and "/" in given:  # neither a preset nor a Hub id
                return (f"model={given}: not a model preset, and not a Hugging Face Hub id "
                        f"({check_repo_id(given) or 'ORG/NAME'}). Give model=ORG/NAME as the Hub shows it, e.g. "
                        "model=Qwen/Qwen3-0.6B, or one of the presets.")
            extra = (" (or model=ORG/NAME for a model on the Hugging Face Hub, or model=local model.path=DIR for "
                     "your own checkpoint)") if group == "model" else ""
            return f"{group}={given}: unknown {what}. Choose one of {', '.join(names)}{extra}."
    if "Could not override" in msg or "not in struct" in msg:
        key = msg.split("'")[1] if "'" in msg else "?"
        return (f"{key}: unknown setting. Check the spelling (infer-bench --cfg job shows every "
                f"setting); to add a new key on purpose write +{key}=...")
    first = msg.splitlines()[0] if msg else type(e).__name__
    return redact_text(f"overrides {' '.join(overrides) or '(none)'}: {first}")


def check_jobs(argv: list[str]) -> list[str]:
    """Problems across every job the command line would run (empty: all clean)."""
    multirun, overrides, checkable = _split_argv(argv)
    if not checkable:
        return []
    try:
        jobs = expand_sweep(overrides) if multirun else [overrides]
    except Exception as e:
        return [f"overrides: {str(e).splitlines()[0]}"]
    problems: list[str] = []
    launcher = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra/launcher=")), "basic")
    n_jobs = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra.launcher.n_jobs=")), "-1")
    parallel = multirun and launcher == "joblib" and n_jobs.strip() != "1"
    for job in jobs:
        label = f"[job {' '.join(job)}] " if multirun and len(jobs) > 1 else ""
        try:
            plan = build_plan(compose_job(job))
            if parallel and plan.device.startswith("cuda") and len(jobs) > 1:
                problems.append(f"{label}hydra/launcher=joblib runs jobs in parallel, and this job uses "
                                f"device={plan.device}: jobs sharing a GPU would measure each other. Add "
                                "hydra.launcher.n_jobs=1 (or give each job its own device).")
        except UserError as e:
            problems += [label + p for p in e.problems]
        except Exception as e:  # Hydra could not compose the config
            problems.append(label + _hydra_problem(e, job))
    return list(dict.fromkeys(problems))


# ---- one job ---------------------------------------------------------------------------------

def run_job(cfg: DictConfig) -> int:
    data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    try:
        plan = build_plan(data)  # type: ignore[arg-type]
    except UserError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run_lock = lock_run_dir(out_dir)
    except UserError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return _run_locked(cfg, data, plan, out_dir)
    finally:
        run_lock.close()


def _run_locked(cfg: DictConfig, data: dict[str, Any], plan: Any, out_dir: Path) -> int:
    try:
        previous = _resume_rows(data.get("resume"), out_dir)
        device_lock = lock_device(plan.device)
    except UserError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
    say = (lambda *a: None) if plan.settings.quiet else (lambda *a: print(*a, flush=True))
    if plan.hub is not None:  # a Hub model: the snapshot (id, commit, size) before anything runs, then its weights
        say(plan.hub.describe())
        try:
            model_path = plan.hub.download(progress=not plan.settings.quiet)
        except UserError as e:
            print(e.render(), file=sys.stderr)
            if device_lock is not None:
                device_lock.close()
            return EXIT_BAD_INPUT
    elif plan.model_cfg.get("path"):
        model_path = str(Path(plan.model_cfg["path"]).expanduser().resolve())
    else:
        cache = model_cache_dir(plan.settings.model_cache_dir)
        if not (cached_path(plan.shape, cache) / "config.json").exists():
            say(f"model {plan.shape.name}: training it from scratch into {cache} (first use: minutes; "
                f"infer-bench-model --train --preset {plan.shape.name} does it ahead; the shipped checkpoint "
                f"is not this preset's: {shipped_mismatch(plan.shape)}) ..." if plan.shape.trained else
                f"model {plan.shape.name}: materialising random weights into {cache} (first use) ...")
        model_path = str(ensure_checkpoint(plan.shape, cache))
    plan.token_range = prompt_token_range(shape_from_hf_config(model_path), model_path)
    try:  # a draft model the workload or an engine option names: materialised too, then checked on disk
        plan.models = extra_models(plan, model_path, say)
    except UserError as e:
        print(e.render(), file=sys.stderr)
        if device_lock is not None:
            device_lock.close()
        return EXIT_BAD_INPUT
    redact = plan.redactor()
    env = redact.obj({**environment(), **({"model": plan.hub.record()} if plan.hub else {})})
    atomic_write_text(out_dir / ENVIRONMENT_FILE, json.dumps(env, indent=2))
    atomic_write_text(out_dir / CONFIG_FILE, redact.text(OmegaConf.to_yaml(cfg, resolve=True)))
    say(f"infer-bench: {plan.workload.name} on {plan.shape.name} ({plan.dtype}, {plan.device}, "
        f"{len(plan.cpus)} cores {plan.cpus}), engines {', '.join(plan.engines)}, {len(plan.points)} points -> {out_dir}")
    if previous:
        say(f"resume: {len(previous)} rows already in {out_dir / RESULTS_FILE}; running only what is missing")
    runner = Runner(plan, model_path, out_dir, env, previous=previous)
    interrupted = False
    previous_term = signal.signal(signal.SIGTERM, _terminate)  # e.g. a scheduler pre-empting the job
    try:
        rows = runner.run()
    except KeyboardInterrupt:
        interrupted = True
        rows = runner.rows
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        if device_lock is not None:
            device_lock.close()
    for planned in plan.workloads:
        text = planned.workload.summary(rows if planned is plan.workloads[0]
                                        else [r for r in rows if r.get("workload") == planned.workload.name])
        if text:
            print(text)
    print(f"results: {out_dir / RESULTS_FILE}")
    write_run_report(out_dir)
    if (data.get("history") or {}).get("path"):  # the performance history (docs/history.md)
        from harness.core.history import ingest_after_run
        ingest_after_run(data["history"]["path"], out_dir)
    if interrupted:
        print(f"interrupted: {len(rows)} rows of this run kept in {out_dir / RESULTS_FILE}; resume with "
              f"+resume={out_dir} hydra.run.dir={out_dir}", file=sys.stderr)
        record_exit(EXIT_INTERRUPTED)
        raise KeyboardInterrupt  # stop a multirun too
    reasons = exit_reasons(rows, plan)
    for why in reasons:
        print(f"infer-bench: exit {EXIT_POINT_FAILED}: {why}", file=sys.stderr)
    return EXIT_POINT_FAILED if reasons else EXIT_OK


def model_directory(ref: str, cache: Path, say: Any = print) -> str:
    """A model reference as a local directory: a preset materialised into the cache (trained
    first when it is a trained preset that is not shipped), else the path as given, absolute."""
    if ref in preset_names():
        shape = load_preset(ref)
        if not (cached_path(shape, cache) / "config.json").exists():
            say(f"model {ref}: {'training' if shape.trained else 'materialising'} it into {cache} (first use) ...")
        return str(ensure_checkpoint(shape, cache))
    return str(Path(ref).expanduser().resolve())


def extra_models(plan: Any, model_path: str, say: Any = print) -> dict[str, str]:
    """The checkpoints besides the model that the workloads name (`Workload.models`: a draft) and
    that engine options name (`engine_options.<engine>.draft_model`), each as a directory; an
    engine option is rewritten to it, so engines always receive a directory. Then each workload's
    `check_models` against the files on disk: UserError with every problem (nothing has run)."""
    cache = model_cache_dir(plan.settings.model_cache_dir)
    models: dict[str, str] = {}
    for w in plan.workloads:
        for ref in w.workload.models(w.cfg):
            models.setdefault(ref, model_directory(ref, cache, say))
    for options in plan.engine_options.values():
        if isinstance(options.get("draft_model"), str):
            options["draft_model"] = models.setdefault(options["draft_model"],
                                                       model_directory(options["draft_model"], cache, say))
    problems = [p for w in plan.workloads for p in w.workload.check_models(w.cfg, model_path, models)]
    if problems:
        raise UserError(problems)
    return models


def exit_reasons(rows: list[dict[str, Any]], plan: Any) -> list[str]:
    """Why the run exits 1 (empty: it exits 0). A verdict never passes on nothing: a failed point,
    a parity check that could not verify an engine, and an engine the user named in `engines=` that
    could not run here each fail the run. With `engines=auto` an engine that is not installed is only
    left out (its `unavailable` row says why)."""
    reasons = []
    failed = [r for r in rows if r.get("status") == "failed" and not any(
        w.workload.name == r.get("workload") and w.workload.expected_failure(r) for w in plan.workloads)]
    if failed:
        engines = ", ".join(dict.fromkeys(r["engine"] for r in failed))
        reasons.append(f"{len(failed)} point{'s' if len(failed) > 1 else ''} failed ({engines}); each row's "
                       "error says why")
    for r in rows:
        if r.get("status") == "unverified":
            reasons.append(f"{r['engine']}: {r.get('workload') or 'parity'} unverified: "
                           f"{(r.get('error') or '').splitlines()[0]}")
    for w in plan.workloads:  # a workload's own verdict over the run (speculative: a lossless check that compared nothing)
        reasons += w.workload.run_problems([r for r in rows if r.get("workload") == w.workload.name])
    if plan.settings.engines != "auto":
        for r in rows:
            if r.get("status") == "unavailable" and r.get("engine") in plan.engines:
                reasons.append(f"{r['engine']} was named in engines= and is unavailable: "
                               f"{(r.get('error') or '').splitlines()[0]}")
    return reasons


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _resume_rows(resume: Any, out_dir: Path) -> list[dict[str, Any]]:
    """The rows already in out_dir, when resuming; else none. `+resume=DIR` names the run
    directory (single run) or the multirun's sweep directory."""
    if not resume:
        return []
    target = Path(str(resume)).expanduser().resolve()
    here = out_dir.resolve()
    if here != target and target not in here.parents:
        raise UserError(f"resume={resume}: this run writes to {out_dir}, not there. Resume with "
                        f"+resume=DIR hydra.run.dir=DIR (or hydra.sweep.dir=DIR for a multirun).")
    path = here / RESULTS_FILE
    return read_rows(path) if path.exists() else []


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _app(cfg: DictConfig) -> int:
    code = run_job(cfg)
    record_exit(code)
    if HydraConfig.get().mode == RunMode.MULTIRUN:  # for the multirun's end, whichever process this job ran in
        write_job_exit(Path(HydraConfig.get().runtime.output_dir), code)
    return code


def parity_model(overrides: list[str]) -> list[str]:
    """`workload=parity` with no model named: PARITY_MODEL where its checkpoint is at hand -
    shipped with the project (harness/shipped/) or trained here and cached (its distributions decide
    parity in bf16, random weights' do not: docs/metrics.md) - said on stderr; else the overrides as
    they are (`tiny`: nothing is trained for a default)."""
    if "workload=parity" not in overrides or any(o.lstrip("+~").startswith(("model=", "model.")) for o in overrides):
        return overrides
    cache = next((o.split("=", 1)[1] for o in overrides if o.startswith("model_cache_dir=")), None)
    path = cached_path(load_preset(PARITY_MODEL), model_cache_dir(cache if cache not in (None, "null") else None))
    if not (path / "config.json").is_file():
        return overrides
    where = "shipped with infer-bench" if path == shipped_checkpoint(load_preset(PARITY_MODEL)) else \
        "trained here and cached"
    print(f"workload=parity: model={PARITY_MODEL}, {where} ({path}); model=tiny for random weights",
          file=sys.stderr)
    return overrides + [f"model={PARITY_MODEL}"]


def main() -> None:
    sys.argv[1:] = parity_model(open_mappings(sys.argv[1:]))
    register_hub_shorthands(sys.argv[1:])  # model=ORG/NAME, also in a multirun's sweep
    problems = check_jobs(sys.argv[1:])
    if problems:
        print(UserError(problems).render(), file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    try:
        _app()
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(EXIT["code"])


if __name__ == "__main__":
    main()
