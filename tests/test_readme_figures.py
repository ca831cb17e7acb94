"""Every figure in the README's Results section says where it came from: each block of the section
that carries a number names the commit it was measured at (scripts/readme_figures.py writes the
label), and that commit exists in this repository's history."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from harness.core.paths import REPO_ROOT

LABEL = re.compile(r"\[commit ([0-9a-f]{7,40})[^\]]*\]")


def results_blocks(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every `###` block of the README's `## Results` section; the text before
    the first block comes as heading ''. Code fences (the commands) are dropped."""
    start = text.index("\n## Results")
    end = text.find("\n## ", start + 1)
    section = re.sub(r"```.*?```", "", text[start:end if end > 0 else None], flags=re.S)
    parts = re.split(r"\n### ", section)
    blocks = [("", parts[0].split("\n", 2)[-1])]
    for p in parts[1:]:
        heading, _, body = p.partition("\n")
        blocks.append((heading, body))
    return blocks


def number_lines(body: str) -> list[str]:
    return [ln for ln in body.splitlines() if re.search(r"\d", LABEL.sub("", ln))]


def test_the_block_splitter_sees_labels_and_numbers():
    text = "x\n## Results\n\nintro\n\n### A\n\n[commit abcdef1, CPU]\n\n```\ncmd 1\n```\n\n| 3 |\n\n## Next\n9"
    blocks = results_blocks(text)
    assert [h for h, _ in blocks] == ["", "A"]
    assert number_lines(blocks[0][1]) == [] and number_lines(blocks[1][1]) == ["| 3 |"]
    assert LABEL.search(blocks[1][1]).group(1) == "abcdef1"


@pytest.mark.skipif(shutil.which("git") is None or not (REPO_ROOT / ".git").exists(),
                    reason="needs the repository's git history to check the commits named")
def test_every_number_in_the_results_carries_a_commit_that_exists():
    text = (REPO_ROOT / "README.md").read_text()
    problems = []
    for heading, body in results_blocks(text):
        lines = number_lines(body)
        if not lines:
            continue
        labels = LABEL.findall(body)
        if not labels:
            problems.append(f"{heading or 'the Results intro'}: numbers without a commit label, e.g. {lines[0][:80]!r}")
        for commit in labels:
            r = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO_ROOT, capture_output=True)
            if r.returncode != 0:
                problems.append(f"{heading}: commit {commit} is not in this repository's history")
    assert not problems, "\n".join(problems)
