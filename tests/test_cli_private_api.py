"""The one private Hydra API the command line uses (hydra._internal's BasicSweeper, to expand
and check every job of a multirun before any runs): this test fails loudly if Hydra moves it."""

from harness.cli import expand_sweep


def test_basic_sweeper_expands_a_multirun_into_its_jobs():
    jobs = expand_sweep(["model=tiny,small", "workload.batch_sizes=[1],[2,4]", "dtype=float32"])
    assert len(jobs) == 4
    assert {tuple(sorted(j)) for j in jobs} == {
        tuple(sorted([f"model={m}", f"workload.batch_sizes={b}", "dtype=float32"]))
        for m in ("tiny", "small") for b in ("[1]", "[2,4]")}
