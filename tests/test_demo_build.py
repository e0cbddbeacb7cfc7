"""`dflash demo build`: the recipe end to end on a tiny budget (--quick), resuming, and its guards; the
recipe's defaults against the shipped pair they come from."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from dflash.cli import main as cli_main
from dflash.defaults import DEMO_DIR
from dflash.demo.build import OUTPUTS, STAGES
from dflash.demo.recipe import QUICK, Recipe


def build(work: Path, *flags: str) -> int:
    return cli_main(["demo", "build", "--quick", "--work", str(work), "--threads", "1", *flags])


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> Path:
    """A whole --quick build (about a minute on 2 idle cores), installed into a directory of the test's."""
    work = tmp_path_factory.mktemp("demo") / "work"
    start = time.monotonic()
    assert build(work, "--install-to", str(work.parent / "pair")) == 0
    print(f"dflash demo build --quick: {time.monotonic() - start:.0f} s")
    return work


def test_quick_build_runs_every_stage_and_installs_a_working_pair(quick):
    from dflash.loading import build_engine
    from dflash.params import SamplingParams

    r = QUICK
    assert json.loads((quick / "recipe.json").read_text()) == r.to_dict()
    for output in OUTPUTS.values():
        assert (quick / output).exists(), output
    # corpus: each kind of prompt as many as the recipe asks; held-out prompts apart
    kinds = [rec["id"].rsplit("-", 1)[0] for rec in records(quick / "prompts.jsonl")]
    assert (kinds.count("definition"), kinds.count("unseen"), kinds.count("midfile")) == (
        r.corpus.definition_prompts, r.corpus.unseen_prompts, r.corpus.midfile_prompts)
    assert len(records(quick / "heldout.jsonl")) == r.corpus.eval_prompts
    # data: one target completion per prompt, and the same text for the AR draft
    regenerated = records(quick / "regenerated.jsonl")
    assert len(regenerated) == len(kinds) and all(len(x["response_ids"]) <= r.regen_max_new_tokens for x in regenerated)
    assert [x["text"] for x in records(quick / "ar-data.jsonl")] == [x["prompt"] + x["response"] for x in regenerated]
    # the models have the recipe's shapes and ran its steps
    target = json.loads((quick / "target" / "metrics.json").read_text())
    assert (target["steps"], target["model_config"]["num_hidden_layers"]) == (r.target.steps, r.target.layers)
    ar = json.loads((quick / "ar-draft" / "metrics.json").read_text())
    assert (ar["steps"], ar["model_config"]["num_hidden_layers"]) == (r.ar_draft.steps, r.ar_draft.layers)
    drafter = json.loads((quick / "drafter" / "config.json").read_text())
    assert drafter["num_hidden_layers"] == r.drafter.layers and drafter["block_size"] == r.drafter.block_size
    assert drafter["dflash_config"]["target_layer_ids"] == list(r.drafter.target_layer_ids)
    steps = [x["step"] for x in records(quick / "drafter" / "train_log.jsonl") if x["event"] == "train"]
    assert steps[-1] == r.drafter.steps
    # eval: every method at T=0 and T=1
    rows = json.loads((quick / "eval.json").read_text())["results"]
    assert {(x["method"].split()[0], x["block_size"], x["temperature"]) for x in rows} == {
        (m, b, t) for t in (0.0, 1.0) for m, b in (("dflash", 16), ("dflash", 8), ("dflash-confidence-0.05", 16),
                                                   ("autoregressive-draft", 16))}
    assert all(x["tau"] >= 1.0 for x in rows)

    pair = quick.parent / "pair"
    manifest = json.loads((pair / "manifest.json").read_text())
    assert manifest["built_by"] == "dflash demo build --work runs/demo --quick"
    assert manifest["recipe"] == r.to_dict() and manifest["eval"]["results"] == rows
    assert set(manifest["commands"]) == {"tokenizer", "target", "data", "drafter", "ar-draft"}
    assert "--steps 24" in manifest["commands"]["drafter"] and str(quick) not in json.dumps(manifest)
    assert manifest["drafter_metrics"]["heldout_tau"] >= 1.0
    assert (pair / "training_curves.png").stat().st_size > 0
    assert not list(quick.parent.glob("pair.*"))  # installed whole, nothing left beside it
    spec = build_engine(pair / "target", pair / "drafter", device="cpu")
    alone = build_engine(pair / "target", None, device="cpu")
    ids = spec.encode(records(quick / "heldout.jsonl")[0]["prompt"])
    params = SamplingParams(max_new_tokens=24)
    assert spec.run(ids, params).token_ids == alone.run(ids, params).token_ids


def test_quick_build_resumes_and_skips_what_is_done(quick, capsys):
    """A rerun skips finished stages; a stage whose run was interrupted continues from its checkpoint
    (here: the drafter's final weights gone, its checkpoint kept)."""
    log = (quick / "drafter" / "train_log.jsonl").read_text()
    (quick / "drafter" / "model.safetensors").unlink()
    capsys.readouterr()
    assert build(quick, "--stages", "drafter,eval", "--install-to", str(quick.parent / "pair")) == 0
    out = capsys.readouterr().out
    assert "--resume" in out and "== eval: done" in out
    assert (quick / "drafter" / "model.safetensors").is_file()
    # resumed at its last step: no step trained again (only the end-of-run eval is logged again)
    trained = [x["step"] for x in records(quick / "drafter" / "train_log.jsonl") if x["event"] == "train"]
    assert trained == [x["step"] for x in map(json.loads, log.splitlines()) if x["event"] == "train"]

    assert build(quick, "--install-to", str(quick.parent / "pair")) == 0
    out = capsys.readouterr().out
    assert all(f"== {stage}: done" in out for stage in STAGES if stage != "install")


def test_build_refuses_another_recipe_a_foreign_directory_and_the_shipped_pair(quick, tmp_path, capsys):
    # a work directory keeps its recipe
    assert cli_main(["demo", "build", "--work", str(quick), "--stages", "eval"]) == 2
    assert "built with another recipe (ar_draft.batch_size: 8 -> 16)" in capsys.readouterr().err
    assert build(quick, "--budget", "2", "--stages", "eval") == 2
    assert "another recipe (ar_draft.steps: 40 -> 80)" in capsys.readouterr().err
    # files of something else (an older build) are not taken for this build's outputs
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "drafter").mkdir()
    assert build(tmp_path / "old") == 2
    assert "no recipe.json" in capsys.readouterr().err
    # install replaces a whole directory: never one that is not a demo pair, never the shipped one from --quick
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert build(quick, "--stages", "install", "--install-to", str(tmp_path / "mine")) == 2
    assert "no manifest.json" in capsys.readouterr().err and (tmp_path / "mine" / "notes.txt").is_file()
    manifest = (DEMO_DIR / "manifest.json").read_bytes()
    assert build(quick, "--stages", "install", "--install-to", str(DEMO_DIR)) == 2
    assert "does not replace the package's demo pair" in capsys.readouterr().err
    assert (DEMO_DIR / "manifest.json").read_bytes() == manifest
    # a stage whose input is missing names the stage to run first
    assert build(tmp_path / "new", "--stages", "drafter") == 2
    assert "run the corpus stage first" in capsys.readouterr().err
    assert build(tmp_path / "new2", "--stages", "lint") == 2
    assert "unknown stage" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "new")


def test_budget_scales_prompts_and_steps_only():
    r, half = Recipe(), Recipe().scaled(0.5)
    c = half.corpus
    assert (c.definition_prompts, c.unseen_prompts, c.midfile_prompts) == (10000, 3000, 20000)
    assert (half.target.steps, half.target.warmup, half.drafter.steps, half.ar_draft.steps, half.ar_draft.warmup) == (
        400, 40, 8400, 10250, 20)
    unchanged = half.to_dict()
    for part, keys in (("corpus", ("definition_prompts", "unseen_prompts", "midfile_prompts")),
                       ("target", ("steps", "warmup")), ("ar_draft", ("steps", "warmup")), ("drafter", ("steps",))):
        for key in keys:
            unchanged[part][key] = r.to_dict()[part][key]
    assert unchanged == r.to_dict()  # shapes, batches, learning rates and the evaluation stay
    assert Recipe().scaled(1e-9).drafter.steps == 1


def test_recipe_defaults_are_the_shipped_pairs_settings():
    """Shapes as shipped; steps: the shipped models' paths added up; data: the union they trained on."""
    manifest = json.loads((DEMO_DIR / "manifest.json").read_text())
    r = Recipe()
    target = manifest["target_metrics"]
    assert target["train_config"]["steps"] == r.target.steps and target["train_config"]["lr"] == r.target.lr
    for m, config in ((r.target, target["model_config"]), (r.ar_draft, manifest["ar_draft_metrics"]["model_config"])):
        assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (
            m.hidden_size, m.layers, m.intermediate_size)
    assert target["model_config"]["vocab_size"] == r.vocab_size
    drafter = json.loads((DEMO_DIR / "drafter" / "config.json").read_text())
    assert (drafter["num_hidden_layers"], drafter["block_size"]) == (r.drafter.layers, r.drafter.block_size)
    assert drafter["dflash_config"]["target_layer_ids"] == list(r.drafter.target_layer_ids)

    runs = {row["run"]: row for row in manifest["history"]}

    def path_steps(shipped: dict) -> int:
        total, row = 0, shipped
        while row is not None:
            total += row["steps"]
            row = runs.get(row.get("start"))
        return total

    shipped = {row["model"]: row for row in manifest["history"] if row.get("shipped")}
    assert abs(path_steps(shipped["drafter"]) - r.drafter.steps) < 50  # 16834
    assert path_steps(shipped["ar-draft"]) == r.ar_draft.steps  # 20500
    def flag(run: str, name: str) -> float:
        words = runs[run]["command"].split()
        return float(words[words.index(name) + 1])

    d = r.drafter
    names = ("--gamma", "--distill-weight", "--max-anchors", "--max-length")
    assert [flag("drafter-grow3", name) for name in names] == [d.gamma, d.distill_weight, d.max_anchors, d.max_length]
    assert flag("drafter", "--lr") == d.lr and flag("ar-draft", "--lr") == r.ar_draft.lr  # the runs from a random init
    assert "6000" in runs["data-unseen"]["data"] and "15878" in runs["data-more"]["data"]
    assert r.corpus.midfile_prompts == 12000 + 16000 + 12000  # data-fresh, data-fresh2, the 12000 of data-fresh3
    assert r.corpus.eval_prompts == manifest["eval"]["prompts"]
    assert r.eval_max_new_tokens == manifest["eval"]["max_new_tokens"]
