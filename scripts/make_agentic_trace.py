"""Write the shipped agentic trace, workloads/traces/agentic.jsonl (docs/conversation.md, "Agentic traces").

    python scripts/make_agentic_trace.py [--out workloads/traces/agentic.jsonl] [--sessions 6] [--seed 0]

Coding-agent sessions made here, not recorded from a model: every session shares one system prompt
and the same four tools (read_file, search_code, run_tests, edit_file), gets a task about a failing
test in a made-up Python package, and works through several rounds of tool calls (one round with two
calls at once) and their results - test reports, file contents, search hits, all generated from
word lists with a fixed seed - to a summary; half the sessions get a follow-up request from the user
and one more round. Messages carry timestamps (tool run times of 0.2-2.5 s, a user's reply a few
seconds), so the replay's think times are recorded ones. Sized for a CPU run with the shipped
tiny-trained model: every session stays under ~2,500 tokens of its tokenizer with the shipped
template (workloads/traces/chat-tools.jinja).

The lines are OpenAI chat-format conversations exactly as a user's logs would hold them
({"messages": [...], "tools": [...]}; tool_calls with JSON-string arguments; tool messages with
their tool_call_id), so the file doubles as the format's example. The same seed writes the same file.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SYSTEM = ("You are a coding agent working in a Python repository. Use the tools to read code, search it, edit "
          "files and run the tests. Make the smallest change that fixes the problem, run the tests again before "
          "you answer, and end with a short summary of what you changed and why.")

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "the file's path"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"},
                                                        "path": {"type": "string", "description": "a folder"}},
                       "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run pytest on a file or a test and return its report.",
        "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]}}},
    {"type": "function", "function": {
        "name": "edit_file", "description": "Replace a piece of text in a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                                        "new": {"type": "string"}},
                       "required": ["path", "old", "new"]}}},
]

PACKAGES = ["ledger", "tiles", "relay", "harvest", "quill", "orbit"]
NOUNS = ["record", "row", "header", "token", "window", "segment", "batch", "route", "frame", "field", "chunk",
         "label", "bucket", "cursor", "span", "node"]
VERBS = ["parse", "load", "merge", "split", "render", "count", "check", "build", "resolve", "encode", "scan", "flush"]
ADJS = ["empty", "last", "first", "nested", "stale", "partial", "unknown", "duplicate"]


def ident(rng: random.Random) -> tuple[str, str]:
    return rng.choice(VERBS), rng.choice(NOUNS)


def function(rng: random.Random, verb: str, noun: str, buggy: bool) -> str:
    """A small Python function of the made-up package (its bug: an off-by-one or a missing case)."""
    other = rng.choice([n for n in NOUNS if n != noun])
    limit = rng.randint(2, 9)
    cond = "if not items:" if not buggy else "if items is None:"
    stop = "len(items)" if not buggy else "len(items) - 1"
    return (f"def {verb}_{noun}s(items, limit={limit}, strict=False):\n"
            f"    \"\"\"{verb.capitalize()} each {noun} of `items` into a {other}; at most `limit` of them.\"\"\"\n"
            f"    {cond}\n"
            f"        return []\n"
            f"    out = []\n"
            f"    for i in range(min({stop}, limit)):\n"
            f"        {noun} = items[i]\n"
            f"        if strict and not {noun}:\n"
            f"            raise ValueError(f\"{noun} {{i}} is empty\")\n"
            f"        out.append(({noun}, i))\n"
            f"    return out\n")


def module(rng: random.Random, pkg: str, name: str, target: tuple[str, str]) -> str:
    parts = [f"\"\"\"{pkg}.{name}: helpers for {rng.choice(NOUNS)}s and {rng.choice(NOUNS)}s.\"\"\"\n",
             "from __future__ import annotations\n", "import re\n"]
    fns = [ident(rng) for _ in range(2)] + [target]
    rng.shuffle(fns)
    for verb, noun in fns:
        parts.append(function(rng, verb, noun, (verb, noun) == target))
    return "\n\n".join(parts)


def test_report(rng: random.Random, target: str, failed: int, passed: int, detail: str) -> str:
    head = f"============================= test session starts ==============================\ncollected {failed + passed} items\n\n"
    marks = ["F"] * failed + ["."] * passed
    rng.shuffle(marks)
    dots = "".join(marks)
    body = f"{target} {dots}\n"
    if failed:
        body += f"\n=================================== FAILURES ===================================\n{detail}\n"
    tail = (f"========================= {failed} failed, {passed} passed in {rng.uniform(0.3, 2.0):.2f}s "
            "=========================" if failed else f"========================= {passed} passed in "
            f"{rng.uniform(0.3, 2.0):.2f}s =========================")
    return head + body + tail


def call(cid: str, name: str, **args: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


class Clock:
    def __init__(self, start: float):
        self.t = start

    def after(self, seconds: float) -> float:
        self.t += seconds
        return round(self.t, 3)


def session(rng: random.Random, k: int, start: float) -> dict:
    pkg = PACKAGES[k % len(PACKAGES)]
    mod = rng.choice(NOUNS) + "s"
    verb, noun = ident(rng)
    path, test = f"src/{pkg}/{mod}.py", f"tests/test_{mod}.py"
    fn = f"{verb}_{noun}s"
    case = f"test_{fn}_{rng.choice(ADJS)}"
    source = module(rng, pkg, mod, (verb, noun))
    clock = Clock(start)
    n = 0

    def cid() -> str:
        nonlocal n
        n += 1
        return f"call_{k}_{n}"

    msgs: list[dict] = [{"role": "system", "content": SYSTEM, "timestamp": clock.after(0)}]
    msgs.append({"role": "user", "timestamp": clock.after(0.1), "content":
                 f"{test}::{case} fails since yesterday's merge in {pkg}. Find out why and fix it; keep the change "
                 "small and don't touch the tests."})

    def assistant(text: str | None, *calls: dict) -> None:
        m = {"role": "assistant", "content": text, "timestamp": clock.after(rng.uniform(0.4, 1.2))}
        if calls:
            m["tool_calls"] = list(calls)
        msgs.append(m)

    def tool(c: dict, result: str, run_s: float) -> None:
        msgs.append({"role": "tool", "tool_call_id": c["id"], "content": result, "timestamp": clock.after(run_s)})

    detail = (f"____________________ {case} ____________________\n\n    def {case}():\n"
              f">       assert {fn}([{noun!r}, {noun!r}], limit=5) == [({noun!r}, 0), ({noun!r}, 1)]\n"
              f"E       AssertionError: assert [({noun!r}, 0)] == [({noun!r}, 0), ({noun!r}, 1)]\n"
              f"E         Right contains one more item: ({noun!r}, 1)\n\n{test}:{rng.randint(12, 80)}: AssertionError")
    c = call(cid(), "run_tests", target=f"{test}::{case}")
    assistant("I'll start by running the failing test to see the error.", c)
    tool(c, test_report(rng, test, 1, rng.randint(3, 9), detail), rng.uniform(1.0, 2.5))
    c = call(cid(), "search_code", pattern=f"def {fn}", path=f"src/{pkg}")
    assistant(f"The last {noun} is dropped. Let me find where {fn} is defined.", c)
    hits = [f"{path}:{rng.randint(5, 60)}:def {fn}(items, limit=..., strict=False):"] + [
        f"src/{pkg}/{rng.choice(NOUNS)}s.py:{rng.randint(5, 90)}:    return {fn}(rows, limit={rng.randint(2, 9)})"
        for _ in range(rng.randint(1, 3))]
    tool(c, "\n".join(hits), rng.uniform(0.2, 0.6))
    c1, c2 = call(cid(), "read_file", path=path), call(cid(), "read_file", path=test)
    assistant(None, c1, c2)  # two calls at once: two results follow
    tool(c1, source, rng.uniform(0.2, 0.5))
    tests = (f"from {pkg}.{mod} import {fn}\n\n\ndef {case}():\n"
             f"    assert {fn}([{noun!r}, {noun!r}], limit=5) == [({noun!r}, 0), ({noun!r}, 1)]\n\n\n"
             f"def test_{fn}_limit():\n    assert len({fn}(list(range(1, 20)), limit=3)) == 3\n")
    tool(c2, tests, rng.uniform(0.2, 0.5))
    c = call(cid(), "edit_file", path=path, old="range(min(len(items) - 1, limit))", new="range(min(len(items), limit))")
    assistant(f"The loop stops one {noun} early: `len(items) - 1`. I'll make it `len(items)`.", c)
    tool(c, f"{path}: 1 replacement", rng.uniform(0.2, 0.4))
    c = call(cid(), "run_tests", target=test)
    assistant(None, c)
    tool(c, test_report(rng, test, 0, rng.randint(4, 10), ""), rng.uniform(1.0, 2.5))
    assistant(f"Fixed: `{fn}` in {path} stopped its loop at `len(items) - 1`, so it dropped the last {noun}. It now "
              f"runs to `len(items)` (still capped by `limit`). {test} passes.")
    if k % 2 == 0:
        msgs.append({"role": "user", "timestamp": clock.after(rng.uniform(2.0, 4.0)),
                     "content": f"Thanks. Does {fn} also mishandle an empty list when strict=True?"})
        c = call(cid(), "run_tests", target=f"{test} -k empty")
        assistant("Let me check with a quick test run.", c)
        tool(c, test_report(rng, test, 0, 1, ""), rng.uniform(1.0, 2.0))
        assistant(f"No: an empty list returns [] before the strict check, with or without strict=True.")
    return {"messages": msgs, "tools": TOOLS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "workloads" / "traces" / "agentic.jsonl"))
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    lines = [session(rng, k, 1_767_225_600.0 + 7.5 * k) for k in range(args.sessions)]  # 2026-01-01, 7.5 s apart
    Path(args.out).write_text("".join(json.dumps(x) + "\n" for x in lines))
    print(f"wrote {args.out}: {len(lines)} sessions, {sum(len(x['messages']) for x in lines)} messages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
