"""The measurements behind parity's thresholds (harness/core/parity.py THRESHOLDS): honest engines
and deliberately broken ones, teacher-forced against the reference engine, per model and dtype.

    .venv/bin/python scripts/parity_thresholds.py [--models tiny,small,tiny-trained]
                                                  [--dtypes float32,bfloat16,float16]
                                                  [--prompt-lens 128,512,1024,2048]
                                                  [--out runs/parity-thresholds]

Each (model, dtype) is one `infer-bench workload=parity` run with the engines: reference (the
baseline), hf (transformers), vllm (when its environment exists), and two broken engines from
tests/plugins/broken_engines.py, registered for the run only (INFER_BENCH_ENGINES): `rope_off` (a
RoPE theta 1 % off) and `shifted` (a KV block read from the wrong offset, chunked prefill). A
threshold is well placed when every honest engine is inside it and every broken one outside.
A model trained here (tiny-trained; a run trains it first when it is not cached, minutes) is
judged against the trained-checkpoint thresholds (THRESHOLDS_TRAINED) on prompts of its held-out
text; the table's threshold row shows the set the rows were checked against. --prompt-lens overrides the parity prompt lengths.
The script prints a Markdown table with the commit and CPU it ran on (docs/metrics.md quotes it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.config import vllm_environment  # noqa: E402
from harness.core.env import cpu_model  # noqa: E402
from harness.core.parity import thresholds  # noqa: E402
from harness.core.results import read_rows  # noqa: E402

BROKEN = "rope_off=broken_engines:RopeOff,shifted=broken_engines:ChunkedShiftedBlockReads"
HONEST = ("reference", "hf", "vllm")


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def run(model: str, dtype: str, out: Path, vllm: bool, prompt_lens: str | None = None) -> list[dict]:
    engines = ["reference", "hf"] + (["vllm"] if vllm else []) + ["rope_off", "shifted"]
    env = dict(os.environ, INFER_BENCH_ENGINES=BROKEN,
               PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "plugins"), str(REPO)]))
    cmd = [sys.executable, "-m", "harness.cli", f"engines=[{','.join(engines)}]", f"model={model}", f"dtype={dtype}",
           "workload=parity", "roofline=false", "quiet=true", f"hydra.run.dir={out}"] + \
        ([f"workload.prompt_lens=[{prompt_lens}]"] if prompt_lens else [])
    print("$ INFER_BENCH_ENGINES=... infer-bench " + " ".join(cmd[3:]), flush=True)
    # the harness appends to a run directory's results; a rerun's table must hold this run's rows only
    (out / "results.jsonl").unlink(missing_ok=True)
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if not (out / "results.jsonl").exists():
        raise SystemExit(f"infer-bench failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return [x for x in read_rows(out / "results.jsonl") if x.get("workload") == "parity"]


def fmt(v, spec=".3g") -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--prompt-lens", default=None, help="parity prompt lengths, e.g. 128,512,1024,2048")
    ap.add_argument("--out", default=str(REPO / "runs" / "parity-thresholds"))
    a = ap.parse_args()
    vllm = vllm_environment() is not None
    lines = [f"Commit {commit()}, {cpu_model()}; vLLM {'from ' + vllm_environment() if vllm else 'absent'}.", "",
             "| model | dtype | engine | kind | status | max \\|Δ log p\\| | mean KL | top-1 (confident) | confident | margin p50 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model in a.models.split(","):
        for dtype in a.dtypes.split(","):
            tag = f"{model}-{dtype}" + (f"-{a.prompt_lens.replace(',', '-')}" if a.prompt_lens else "")
            rows = run(model, dtype, Path(a.out) / tag, vllm, a.prompt_lens)
            trained = any((r.get("parity_thresholds") or {}).get("set") == "trained checkpoint" for r in rows)
            for r in rows:
                if r["engine"] == "reference":
                    continue
                kind = "honest" if r["engine"] in HONEST else "broken"
                lines.append(f"| {model} | {dtype} | {r['engine']} | {kind} | {r['status']} | "
                             f"{fmt(r.get('parity_max_abs_err'))} | {fmt(r.get('parity_mean_kl'))} | "
                             f"{fmt(r.get('parity_top1_agreement'), '.3f')} | {r.get('parity_confident_positions', '-')} | "
                             f"{fmt(r.get('parity_margin_p50'))} |")
            th = thresholds(dtype, trained)
            lines.append(f"| {model} | {dtype} | *threshold ({'trained' if trained else 'random'})* | | | "
                         f"{th[0]:g} | {th[1]:g} | {th[2]:g} | | |")
    text = "\n".join(lines)
    print(text)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "table.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
