"""`dflash demo build`: rebuild the built-in demo pair from the Python standard library, stage by stage.

Every stage is a command line (recorded verbatim in the manifest) that resumes from its own
checkpoint, so an interrupted build continues where it stopped. Stages:

1. tokenizer  byte-level BPE (4096 tokens, with <|MASK|>) on the training modules
2. target     a 6.8M-parameter Qwen3 LM trained from scratch on the training modules
3. prompts    prompts cut from training modules (drafter data) and from held-out modules (evaluation)
4. drafter    `dflash train`: target-regenerated completions, then the DFlash recipe
5. ar-draft   the classic baseline: a small autoregressive LM of about the drafter's cost, trained
              with the same budget on the same regenerated text
6. drafter-extend, ar-extend
              both models trained further side by side, each from its stage's final weights with a
              new schedule and data order (`--init-drafter` / `--init-from`), again with one budget
7. eval       tau at T=0 and T=1, block 8 and 16, on held-out modules, beside the baseline
8. install    bf16 copies into the package's assets/demo with manifest.json and training curves
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from ..defaults import DEMO_DIR
from . import corpus

SEED = 0
NUM_TRAIN_PROMPTS = 8000
NUM_EVAL_PROMPTS = 24
EVAL_MAX_NEW_TOKENS = 128
EVAL_DRAFT_CONFIDENCE = 0.05  # also measured: block 16 with drafts cut at this joint confidence
PY = [sys.executable, "-m"]


def stage_commands(work: Path) -> dict[str, list[str]]:
    """The exact command of every stage that runs a program (prompts, eval and install run in process)."""
    return {
        "tokenizer": PY + ["dflash.demo.tokenizer", "--out", str(work / "tokenizer")],
        "target": PY + [
            "dflash.demo.pretrain", "--out", str(work / "target"), "--tokenizer", str(work / "tokenizer"),
            "--data", "corpus", "--steps", "800", "--batch-size", "32", "--seq-len", "256", "--lr", "1.5e-3",
            "--min-lr-ratio", "0.1", "--warmup", "80", "--weight-decay", "0.1", "--grad-clip", "1.0",
            "--seed", str(SEED), "--checkpoint-every", "50", "--eval-every", "200", "--eval-windows", "64",
            "--threads", "2",
        ],
        "drafter": PY + [
            "dflash.cli", "train", "--target", str(work / "target" / "final"), "--data", str(work / "prompts.jsonl"),
            "--out", str(work / "drafter"), "--regenerate", "--regen-max-new-tokens", "256",
            "--regen-batch-size", "32", "--max-length", "384", "--block-size", "16", "--num-layers", "2",
            "--num-features", "3", "--epochs", "3", "--lr", "1.5e-3", "--batch-size", "8", "--max-anchors", "48",
            "--save-every", "50", "--eval-prompts", str(work / "heldout.jsonl"), "--eval-max-new-tokens", "96",
            "--seed", str(SEED), "--threads", "1", "--device", "cpu",
        ],
        "ar-draft": PY + [
            "dflash.demo.pretrain", "--out", str(work / "ar-draft"), "--tokenizer", str(work / "tokenizer"),
            "--data", str(work / "ar-data.jsonl"), "--layers", "2", "--steps", "4000", "--batch-size", "16",
            "--seq-len", "256", "--lr", "2e-3", "--min-lr-ratio", "0.1", "--warmup", "40", "--seed", str(SEED),
            "--checkpoint-every", "50", "--eval-every", "200", "--eval-windows", "32", "--threads", "1",
        ],
        # About 95 minutes each on one core of the 2-core build machine, run at the same time.
        "drafter-extend": PY + [
            "dflash.cli", "train", "--target", str(work / "target" / "final"),
            "--data", str(work / "drafter" / "regenerated.jsonl"), "--out", str(work / "drafter-extended"),
            "--init-drafter", str(work / "drafter"), "--max-length", "384", "--block-size", "16",
            "--num-layers", "2", "--num-features", "3", "--epochs", "3", "--steps", "2500", "--lr", "1e-3",
            "--batch-size", "8", "--max-anchors", "48", "--distill-weight", "0.5", "--save-every", "50",
            "--eval-prompts", str(work / "heldout.jsonl"), "--eval-max-new-tokens", "96", "--seed", "1",
            "--threads", "1", "--device", "cpu",
        ],
        "ar-extend": PY + [
            "dflash.demo.pretrain", "--out", str(work / "ar-draft-extended"), "--tokenizer", str(work / "tokenizer"),
            "--data", str(work / "ar-data.jsonl"), "--layers", "2", "--steps", "4300", "--batch-size", "16",
            "--seq-len", "256", "--lr", "1.3e-3", "--min-lr-ratio", "0.1", "--warmup", "40", "--seed", "1",
            "--checkpoint-every", "50", "--eval-every", "200", "--eval-windows", "32", "--threads", "1",
            "--init-from", str(work / "ar-draft" / "final"),
        ],
    }


def final_dirs(work: Path) -> tuple[Path, Path]:
    """The drafter and AR draft that eval and install use. Each model's extension replaces its first run
    only if it is better on that run's own validation measure (early stopping, the same rule for both):
    held-out tau at the end of training for the drafter, held-out loss for the AR draft."""
    drafter = work / "drafter"
    if (work / "drafter-extended" / "model.safetensors").is_file() and \
            _last_eval_tau(work / "drafter-extended") > _last_eval_tau(work / "drafter"):
        drafter = work / "drafter-extended"
    ar = work / "ar-draft"
    if (work / "ar-draft-extended" / "final" / "config.json").is_file() and \
            _heldout_loss(work / "ar-draft-extended") < _heldout_loss(work / "ar-draft"):
        ar = work / "ar-draft-extended"
    return drafter, ar / "final"


def _last_eval_tau(run: Path) -> float:
    taus = [r["tau"] for r in map(json.loads, (run / "train_log.jsonl").read_text().splitlines())
            if r.get("event") == "eval"]
    return taus[-1] if taus else 0.0


def _heldout_loss(run: Path) -> float:
    return json.loads((run / "metrics.json").read_text())["heldout_loss"]


def run(cmd: list[str], log: Path) -> None:
    print("$ " + " ".join(cmd), flush=True)
    with open(log, "a") as out:
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT)


def write_prompts(work: Path) -> None:
    """Drafter prompts from training modules; evaluation prompts from held-out modules only."""
    with open(work / "prompts.jsonl", "w") as f:
        for i, p in enumerate(corpus.training_prompts(NUM_TRAIN_PROMPTS, seed=SEED)):
            f.write(json.dumps({"id": f"train-{i}", "prompt": p}) + "\n")
    with open(work / "heldout.jsonl", "w") as f:
        for i, p in enumerate(corpus.heldout_prompts(NUM_EVAL_PROMPTS, seed=SEED)):
            f.write(json.dumps({"id": f"heldout-{i}", "prompt": p}) + "\n")


def write_ar_data(work: Path) -> None:
    """The baseline learns from the same target-regenerated text the drafter learned from."""
    with open(work / "drafter" / "regenerated.jsonl") as src, open(work / "ar-data.jsonl", "w") as dst:
        for line in src:
            rec = json.loads(line)
            dst.write(json.dumps({"text": rec["prompt"] + rec["response"]}) + "\n")


def evaluate(work: Path) -> dict:
    from transformers import AutoTokenizer

    from .evaluate import assisted_tau, dflash_tau

    prompts = [json.loads(line)["prompt"] for line in open(work / "heldout.jsonl")]
    tokenizer = AutoTokenizer.from_pretrained(str(work / "target" / "final"))
    target = work / "target" / "final"
    drafter, ar = final_dirs(work)
    rows = []
    for temperature in (0.0, 1.0):
        for block in (16, 8):
            rows.append(dflash_tau(target, drafter, prompts, block, temperature, EVAL_MAX_NEW_TOKENS))
            print(json.dumps(rows[-1]), flush=True)
        rows.append(dflash_tau(target, drafter, prompts, 16, temperature, EVAL_MAX_NEW_TOKENS, EVAL_DRAFT_CONFIDENCE))
        print(json.dumps(rows[-1]), flush=True)
        rows.append(assisted_tau(target, ar, tokenizer, prompts, 15, temperature, EVAL_MAX_NEW_TOKENS))
        print(json.dumps(rows[-1]), flush=True)
    result = {"heldout_modules": list(corpus.HELD_OUT_MODULES), "prompts": len(prompts),
              "max_new_tokens": EVAL_MAX_NEW_TOKENS, "results": rows}
    (work / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def install(work: Path, dest: Path = DEMO_DIR) -> None:
    """Copy the final models (bf16) and the manifest into the package's assets."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..drafter.checkpoint import load_drafter, save_drafter

    dest.mkdir(parents=True, exist_ok=True)
    drafter, ar = final_dirs(work)
    for name, src in (("target", work / "target" / "final"), ("ar-draft", ar)):
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
        shutil.rmtree(dest / name, ignore_errors=True)
        model.save_pretrained(dest / name, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(dest / name)
    shutil.rmtree(dest / "drafter", ignore_errors=True)
    save_drafter(load_drafter(drafter), dest / "drafter", dtype=torch.bfloat16)
    manifest = {
        "seed": SEED,
        "commands": {k: " ".join(["python"] + v[1:]) for k, v in stage_commands(Path("runs/demo")).items()},
        "rebuild": "dflash demo build --work runs/demo",
        "heldout_modules": list(corpus.HELD_OUT_MODULES),
        "target_metrics": json.loads((work / "target" / "final" / ".." / "metrics.json").read_text()),
        "ar_draft_metrics": json.loads((ar.parent / "metrics.json").read_text()),
        "installed": {"drafter": str(drafter), "ar_draft": str(ar)},
        "selection": {  # the validation measures final_dirs chose by, for every run that exists
            "drafter_heldout_tau": {run: _last_eval_tau(work / run) for run in ("drafter", "drafter-extended")
                                    if (work / run / "train_log.jsonl").is_file()},
            "ar_draft_heldout_loss": {run: _heldout_loss(work / run) for run in ("ar-draft", "ar-draft-extended")
                                      if (work / run / "metrics.json").is_file()},
        },
        "eval": json.loads((work / "eval.json").read_text()),
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    from .curves import plot_curves

    plot_curves(work, dest / "training_curves.png")


def build(work: Path, stages: list[str]) -> None:
    work.mkdir(parents=True, exist_ok=True)
    commands = stage_commands(work)
    log = work / "build.log"
    for stage in stages:
        print(f"== {stage}", flush=True)
        if stage in ("tokenizer", "target", "ar-draft", "drafter", "drafter-extend", "ar-extend"):
            cmd = list(commands[stage])
            out = {"drafter": "drafter", "drafter-extend": "drafter-extended"}.get(stage)
            if out and (work / out / "checkpoint").exists():
                cmd.append("--resume")
            if stage == "ar-draft":
                write_ar_data(work)
            run(cmd, log)
        elif stage == "prompts":
            write_prompts(work)
        elif stage == "eval":
            evaluate(work)
        elif stage == "install":
            install(work)


STAGES = ["tokenizer", "target", "prompts", "drafter", "ar-draft", "drafter-extend", "ar-extend", "eval", "install"]
