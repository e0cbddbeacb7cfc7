"""`dflash demo build`: the built-in demo pair from the Python standard library, in one recipe.

Stages, in order; each resumes from its checkpoint after an interruption and is skipped once its output
(OUTPUTS) exists, so rerunning the same command continues a build (delete an output to redo its stage):

  corpus     prompts.jsonl: prompts cut from the stdlib (definition starts of the training modules and of
             the test suites and tools, mid-file lines of both); heldout.jsonl: held-out module prompts
  tokenizer  tokenizer/: byte-level BPE with <|MASK|>, trained on the training modules
  target     target/final: a Qwen3 LM pretrained from scratch on the training modules
  data       regenerated.jsonl: the target's greedy completion of every prompt (`dflash regenerate`);
             ar-data.jsonl: the same text for the AR draft
  drafter    drafter/: `dflash train` on the regenerated completions
  ar-draft   ar-draft/final: the classic baseline, a small autoregressive LM trained with the same budget
             on the same text
  eval       eval.json: tau on the held-out prompts at T=0 and T=1, block 16 and 8, beside the AR draft
  install    bf16 copies of the three models, manifest.json and training_curves.png, in the install directory

The settings are a dflash.demo.recipe.Recipe (the shipped pair's by default). The work directory keeps its
recipe in recipe.json, and a build with another recipe there is refused. Every stage that trains runs as
its own process (the command is in the manifest); its output goes to build.log.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import DFlashError
from . import corpus
from .recipe import LM, Recipe, first_difference

STAGES = ("corpus", "tokenizer", "target", "data", "drafter", "ar-draft", "eval", "install")
# A stage is done when its output exists (install always runs).
OUTPUTS = {"corpus": "heldout.jsonl", "tokenizer": "tokenizer/tokenizer.json", "target": "target/metrics.json",
           "data": "ar-data.jsonl", "drafter": "drafter/model.safetensors", "ar-draft": "ar-draft/metrics.json",
           "eval": "eval.json"}
NEEDS = {"corpus": (), "tokenizer": (), "target": ("tokenizer",), "data": ("corpus", "target"),
         "drafter": ("corpus", "data"), "ar-draft": ("tokenizer", "data"), "eval": ("corpus", "drafter", "ar-draft"),
         "install": ("eval",)}
SEED = Recipe().seed
NUM_EVAL_PROMPTS = Recipe().corpus.eval_prompts
# The manifest's commands are written for this work directory (a path of the build machine would mean
# nothing elsewhere).
MANIFEST_WORK = Path("runs/demo")
PY = [sys.executable, "-m"]


@dataclass(frozen=True)
class Build:
    """One `dflash demo build`: where, with which recipe, how many CPU threads, and where to install."""

    work: Path
    recipe: Recipe
    threads: int
    install_to: Path
    command: str  # the `dflash demo build` command line, recorded in the manifest


def build(b: Build, stages: tuple[str, ...] = STAGES) -> None:
    """Run `stages` (in STAGES order) in b.work, skipping those whose output exists."""
    b.work.mkdir(parents=True, exist_ok=True)
    check_work(b.work, b.recipe)
    if "install" in stages:
        check_install_to(b.install_to)  # before hours of training, not after
    for stage in stages:
        output = OUTPUTS.get(stage)
        if output is not None and (b.work / output).exists():
            print(f"== {stage}: done ({b.work / output})", flush=True)
            continue
        for need in NEEDS[stage]:
            if not (b.work / OUTPUTS[need]).exists():
                raise DFlashError(f"the {stage} stage needs '{b.work / OUTPUTS[need]}'; run the {need} stage first")
        print(f"== {stage}", flush=True)
        start = time.time()
        RUNNERS[stage](b)
        print(f"== {stage}: {time.time() - start:.0f} s", flush=True)


def check_work(work: Path, recipe: Recipe) -> None:
    """Record the recipe in a new work directory; refuse one built with another recipe, or one that holds
    files of something else (an older build), whose finished outputs the stages would take for theirs."""
    path, now = work / "recipe.json", recipe.to_dict()
    if path.is_file():
        difference = first_difference(json.loads(path.read_text()), now)
        if difference:
            raise DFlashError(f"'{work}' was built with another recipe ({difference}); pass the same --quick "
                              "and --budget, or choose a new --work")
        return
    if any(work.iterdir()):
        raise DFlashError(f"'{work}' holds files but no recipe.json, so not this build's; choose a new --work")
    _write_text(path, json.dumps(now, indent=2) + "\n")


# -- the commands of the stages that run a program ---------------------------------------------------------

def lm_flags(m: LM) -> list[str]:
    """dflash.demo.pretrain's flags for one LM of the recipe."""
    return ["--hidden-size", str(m.hidden_size), "--layers", str(m.layers), "--heads", str(m.heads),
            "--kv-heads", str(m.kv_heads), "--head-dim", str(m.head_dim), "--intermediate-size",
            str(m.intermediate_size), "--steps", str(m.steps), "--batch-size", str(m.batch_size),
            "--seq-len", str(m.seq_len), "--lr", f"{m.lr:g}", "--min-lr-ratio", f"{m.min_lr_ratio:g}",
            "--warmup", str(m.warmup), "--weight-decay", f"{m.weight_decay:g}", "--eval-windows", str(m.eval_windows),
            "--checkpoint-every", "50", "--eval-every", "200"]


def commands(work: Path, r: Recipe, threads: int, drafter_epochs: int | None = None) -> dict[str, list[str]]:
    """The exact command of every stage that runs a program, for work directory `work`; the drafter's once
    its epochs are known (`drafter_epochs`, from the data)."""
    max_files = ["--max-files", str(r.corpus.max_files)] if r.corpus.max_files is not None else []
    d = r.drafter
    programs = {
        "tokenizer": PY + ["dflash.demo.tokenizer", "--out", str(work / "tokenizer"), "--vocab-size",
                           str(r.vocab_size), *max_files],
        "target": PY + ["dflash.demo.pretrain", "--out", str(work / "target"), "--tokenizer", str(work / "tokenizer"),
                        "--data", "corpus", *max_files, *lm_flags(r.target), "--seed", str(r.seed),
                        "--threads", str(threads)],
        "data": PY + ["dflash.cli", "regenerate", "--target", str(work / "target" / "final"),
                      "--data", str(work / "prompts.jsonl"), "--out", str(work / "regenerated.jsonl"),
                      "--max-new-tokens", str(r.regen_max_new_tokens),
                      "--max-prompt-tokens", str(d.max_length - d.block_size), "--batch-size", str(r.regen_batch_size),
                      "--device", "cpu", "--threads", str(threads)],
        "drafter": PY + ["dflash.cli", "train", "--target", str(work / "target" / "final"),
                         "--data", str(work / "regenerated.jsonl"), "--out", str(work / "drafter"),
                         "--num-layers", str(d.layers), "--target-layer-ids", ",".join(map(str, d.target_layer_ids)),
                         "--block-size", str(d.block_size), "--max-length", str(d.max_length),
                         "--epochs", str(drafter_epochs), "--steps", str(d.steps), "--lr", f"{d.lr:g}",
                         "--batch-size", str(d.batch_size), "--max-anchors", str(d.max_anchors),
                         "--gamma", f"{d.gamma:g}", "--distill-weight", f"{d.distill_weight:g}", "--save-every", "50",
                         "--eval-prompts", str(work / "heldout.jsonl"), "--eval-max-new-tokens",
                         str(d.eval_max_new_tokens), "--seed", str(r.seed), "--threads", str(threads),
                         "--device", "cpu"],
        "ar-draft": PY + ["dflash.demo.pretrain", "--out", str(work / "ar-draft"), "--tokenizer",
                          str(work / "tokenizer"), "--data", str(work / "ar-data.jsonl"), *lm_flags(r.ar_draft),
                          "--seed", str(r.seed), "--threads", str(threads)],
    }
    if drafter_epochs is None:
        del programs["drafter"]
    return programs


def drafter_epochs(regenerated: Path, r: Recipe) -> int:
    """The passes over the regenerated data that the drafter's steps need (`dflash train` stops at
    --steps and fits its schedule to them). A completion of fewer than 2 tokens is not trained on."""
    with open(regenerated) as f:
        samples = sum(1 for line in f if line.strip() and len(json.loads(line)["response_ids"]) >= 2)
    steps_per_epoch = max(1, math.ceil(samples / r.drafter.batch_size))
    return max(1, math.ceil(r.drafter.steps / steps_per_epoch))


def run(stage: str, cmd: list[str], log: Path) -> None:
    """Run one stage's program, its output appended to `log`."""
    print("$ " + " ".join(cmd), flush=True)
    with open(log, "a") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise DFlashError(f"the {stage} stage's program exited with status {code}; its output is in '{log}'")


# -- the stages ------------------------------------------------------------------------------------------

def write_corpus(b: Build) -> None:
    """The drafter's prompts (definition starts of the training modules, of the test suites and tools, and
    mid-file lines of both) and the held-out evaluation prompts."""
    c, seed = b.recipe.corpus, b.recipe.seed
    kinds = (("definition", corpus.training_prompts(c.definition_prompts, c.prompt_chars, seed)),
             ("unseen", corpus.unseen_prompts(c.unseen_prompts, c.prompt_chars, seed)),
             ("midfile", corpus.midfile_prompts(c.midfile_prompts, c.prompt_chars, seed)))
    _write_jsonl(b.work / "prompts.jsonl",
                 ({"id": f"{kind}-{i}", "prompt": p} for kind, prompts in kinds for i, p in enumerate(prompts)))
    heldout = corpus.heldout_prompts(c.eval_prompts, c.prompt_chars, seed)
    _write_jsonl(b.work / "heldout.jsonl", ({"id": f"heldout-{i}", "prompt": p} for i, p in enumerate(heldout)))
    print("corpus: " + ", ".join(f"{len(p)} {kind}" for kind, p in kinds) + f" prompts; {len(heldout)} held-out",
          flush=True)


def _program(stage: str) -> Callable[[Build], None]:
    def runner(b: Build) -> None:
        run(stage, commands(b.work, b.recipe, b.threads)[stage], b.work / "build.log")

    return runner


def regenerate_data(b: Build) -> None:
    """The target's completions (`dflash regenerate` resumes where it stopped), then the AR draft's text."""
    run("data", commands(b.work, b.recipe, b.threads)["data"], b.work / "build.log")
    with open(b.work / "regenerated.jsonl") as src:
        texts = [json.loads(line) for line in src if line.strip()]
    _write_jsonl(b.work / "ar-data.jsonl", ({"text": t["prompt"] + t["response"]} for t in texts))


def train_drafter(b: Build) -> None:
    cmd = commands(b.work, b.recipe, b.threads, drafter_epochs(b.work / "regenerated.jsonl", b.recipe))["drafter"]
    if (b.work / "drafter" / "checkpoint").exists():
        cmd.append("--resume")  # `dflash train` refuses to start over a checkpoint without it
    run("drafter", cmd, b.work / "build.log")


def evaluate(b: Build) -> None:
    import torch

    from .evaluate import evaluate_pair

    prompts = [json.loads(line)["prompt"] for line in open(b.work / "heldout.jsonl")]
    threads = torch.get_num_threads()
    torch.set_num_threads(b.threads)
    try:
        rows = evaluate_pair(b.work / "target" / "final", b.work / "drafter", b.work / "ar-draft" / "final",
                             prompts, b.recipe.eval_max_new_tokens)
    finally:
        torch.set_num_threads(threads)
    result = {"heldout_modules": list(corpus.HELD_OUT_MODULES), "prompts": len(prompts),
              "max_new_tokens": b.recipe.eval_max_new_tokens, "results": rows}
    _write_text(b.work / "eval.json", json.dumps(result, indent=2) + "\n")


def install(b: Build) -> None:
    """bf16 copies of the target (with its tokenizer), drafter and AR draft, the manifest and the curves."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..drafter.checkpoint import load_drafter, save_drafter
    from .curves import plot_curves

    work, r = b.work, b.recipe
    check_install_to(b.install_to)
    # Written beside it, then swapped in whole: no file of an earlier pair stays, none is half-written.
    dest = b.install_to.with_name(b.install_to.name + ".installing")
    shutil.rmtree(dest, ignore_errors=True)
    for name, src in (("target", work / "target" / "final"), ("ar-draft", work / "ar-draft" / "final")):
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
        model.save_pretrained(dest / name, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(dest / name)
    save_drafter(load_drafter(work / "drafter"), dest / "drafter", dtype=torch.bfloat16)
    epochs = drafter_epochs(work / "regenerated.jsonl", r)
    manifest = {
        "built_by": b.command,
        "seed": r.seed,
        "recipe": r.to_dict(),
        "commands": {k: " ".join(["python"] + v[1:]) for k, v in commands(MANIFEST_WORK, r, b.threads, epochs).items()},
        "heldout_modules": list(corpus.HELD_OUT_MODULES),
        "target_metrics": _lm_metrics(work, "target"),
        "drafter_metrics": drafter_metrics(work / "drafter"),
        "ar_draft_metrics": _lm_metrics(work, "ar-draft"),
        "eval": json.loads((work / "eval.json").read_text()),
    }
    _write_text(dest / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    plot_curves(work, dest / "training_curves.png")
    for path in dest.rglob("*"):
        if path.is_file():
            path.chmod(0o644)  # package data, readable by all (safetensors writes 0600)
    if b.install_to.exists():
        old = b.install_to.with_name(b.install_to.name + ".old")
        os.replace(b.install_to, old)
        os.replace(dest, b.install_to)
        shutil.rmtree(old)
    else:
        os.replace(dest, b.install_to)
    print(f"installed in '{b.install_to}'", flush=True)


def check_install_to(dest: Path) -> None:
    """install replaces the whole directory: only an empty one or an installed pair (manifest.json) may be."""
    if dest.is_dir() and any(dest.iterdir()) and not (dest / "manifest.json").is_file():
        raise DFlashError(f"--install-to '{dest}' holds files but no manifest.json, so no demo pair; install "
                          "replaces the whole directory: choose a new or empty one")


def _lm_metrics(work: Path, run: str) -> dict:
    """A pretrain run's metrics.json, its data path written for MANIFEST_WORK as the commands are."""
    metrics = json.loads((work / run / "metrics.json").read_text())
    data = Path(metrics["data"])
    if data.is_relative_to(work):
        metrics["data"] = str(MANIFEST_WORK / data.relative_to(work))
    return metrics


def drafter_metrics(run_dir: Path) -> dict:
    """The drafter's held-out tau (greedy, on the held-out prompts) at the end of training, and its steps."""
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if r.get("event") == "eval"]
    return {"heldout_tau": evals[-1]["tau"] if evals else None,
            "steps": max((r["step"] for r in records if "step" in r), default=0)}


RUNNERS: dict[str, Callable[[Build], None]] = {
    "corpus": write_corpus, "tokenizer": _program("tokenizer"), "target": _program("target"),
    "data": regenerate_data, "drafter": train_drafter, "ar-draft": _program("ar-draft"), "eval": evaluate,
    "install": install,
}


def _write_text(path: Path, text: str) -> None:
    """Write atomically: a stage is done when its output exists, so no output may exist half-written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_jsonl(path: Path, records: Iterable[dict]) -> None:
    _write_text(path, "".join(json.dumps(record) + "\n" for record in records))
