"""The committed demo pair: it loads, it is lossless, and its manifest tells how it was made."""

import json
from pathlib import Path

import pytest
from dflash.defaults import DEMO_AR_DRAFT, DEMO_DIR, demo_pair
from dflash.demo.corpus import heldout_prompts
from dflash.loading import build_engine
from dflash.params import SamplingParams
from dflash.scheduler import SchedulerConfig


@pytest.fixture(scope="module")
def engines():
    target, drafter = demo_pair()
    full = SchedulerConfig(verify_policy="full")
    return (build_engine(target, drafter, device="cpu"), build_engine(target, drafter, device="cpu", scheduler=full),
            build_engine(target, None, device="cpu"))


def test_demo_pair_is_lossless_on_heldout_prompts(engines):
    """Both verify policies give the target's own output; with whole blocks verified (the adaptive policy
    may decode a lone CPU stream plainly, where that is faster) the trained drafter is accepted."""
    adaptive, full, alone = engines
    taus = []
    for prompt in heldout_prompts(4, seed=1):
        ids = alone.encode(prompt)
        for params in (SamplingParams(max_new_tokens=64), SamplingParams(max_new_tokens=48, temperature=1.0, seed=3)):
            want = alone.run(ids, params)
            for spec in (adaptive, full):
                got = spec.run(ids, params)
                assert (got.token_ids, got.text) == (want.token_ids, want.text)
            taus.append(got.stats.tau)
    assert min(taus) > 1.0  # the trained drafter is accepted, greedy and sampled


def test_manifest_records_how_the_shipped_pair_was_made():
    """The shipped pair came from a longer path of runs than `dflash demo build`'s recipe: the manifest lists
    every run (its command, the run it started from, data, steps, validation measure, kept or not), and the
    runs kept lead from a random init to the shipped models."""
    manifest = json.loads((DEMO_DIR / "manifest.json").read_text())
    assert manifest["seed"] == 0
    taus = {(r["method"].split()[0], r["block_size"], r["temperature"]): r["tau"] for r in manifest["eval"]["results"]}
    assert ("dflash", 16, 0.0) in taus and ("dflash", 8, 1.0) in taus
    history = manifest["history"]
    runs = {row["run"]: row for row in history}
    assert len(runs) == len(history) and all(row["command"].startswith("python -m dflash.") for row in history)
    for i, row in enumerate(history):
        if row["model"] in ("drafter", "ar-draft"):
            assert row["steps"] > 0 and ("heldout_tau" in row) != ("heldout_loss" in row), row["run"]
            if "start" in row:  # an earlier run of the same model, named in the command
                assert history.index(runs[row["start"]]) < i and runs[row["start"]]["model"] == row["model"]
                assert runs[row["start"]]["kept"] and f"runs/demo/{row['start']}" in row["command"]
    shipped = {row["model"]: row for row in history if row.get("shipped")}
    assert set(shipped) == {"drafter", "ar-draft"}
    assert manifest["drafter_metrics"]["heldout_tau"] == shipped["drafter"]["heldout_tau"]
    assert manifest["ar_draft_metrics"]["heldout_loss"] == shipped["ar-draft"]["heldout_loss"]
    assert (DEMO_DIR / "training_curves.png").is_file()
    assert (DEMO_AR_DRAFT / "config.json").is_file()


def test_docs_table_is_the_manifest_history():
    """docs/training.md's record of the demo pair has one row per model run of the manifest, with its steps and
    held-out measure."""
    manifest = json.loads((DEMO_DIR / "manifest.json").read_text())
    docs = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in docs.splitlines() if line.startswith("| `")}
    for run in (row for row in manifest["history"] if row["model"] in ("target", "drafter", "ar-draft")):
        line = rows[run["run"]]
        measure = run.get("heldout_tau", run.get("heldout_loss"))
        if measure is not None:
            assert f"{measure:.2f}" in line, run["run"]
        if "steps" in run:
            assert f"| {run['steps']} |" in line, run["run"]
