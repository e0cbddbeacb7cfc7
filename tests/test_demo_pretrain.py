"""Fast checks of the demo corpus, tokenizer, resumable pretraining loop and build stages."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash.demo import corpus
from dflash.demo.build import AR_LINEAGE, DRAFTER_LINEAGE, stage_commands
from dflash.errors import CheckpointError
from dflash.demo.pretrain import TrainConfig, demo_model_config, train_lm
from dflash.demo.tokenizer import MASK_TOKEN, build_tokenizer

SAMPLE = 'def área(r):\n    """Circle area."""\n    return 3.14159 * r ** 2  # ok\n'


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return corpus.load_texts("train", max_files=8)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, texts):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, vocab_size=512, texts=texts)
    return out


def _tiny_config(vocab: int):
    return demo_model_config(
        vocab_size=vocab,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
        max_position_embeddings=128,
    )


def _train(tok_dir, out, texts, steps, stop_after=None, init_from=None, **cfg):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    defaults = dict(steps=steps, batch_size=4, seq_len=32, lr=3e-3, warmup=2,
                    checkpoint_every=3, eval_every=1000, eval_windows=4)
    defaults.update(cfg)
    return train_lm(
        _tiny_config(len(tok)), tok_dir, out, TrainConfig(**defaults),
        texts=texts, heldout_texts=texts[:1], stop_after=stop_after, progress=False, init_from=init_from,
    )


def _losses(out) -> list[float]:
    lines = (out / "train_log.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_corpus_splits_are_disjoint():
    held = set(corpus.list_files("heldout"))
    assert len(held) == len(corpus.HELD_OUT_MODULES)
    assert held.isdisjoint(corpus.list_files("train")[:50])
    assert corpus.heldout_prompts(4, 200, seed=1) == corpus.heldout_prompts(4, 200, seed=1)


def test_unseen_split_is_stdlib_code_the_target_never_trained_on():
    """Drafter-only data: the stdlib's test/tool folders; never a training file, a held-out module,
    third-party code or a build folder."""
    root = corpus.stdlib_root()
    unseen = corpus.list_files("unseen")
    assert unseen, "this Python ships no test suite or tools"
    rels = [p.relative_to(root) for p in unseen]
    assert set(unseen).isdisjoint(corpus.list_files("train"))
    assert set(unseen).isdisjoint(corpus.list_files("heldout"))
    for rel in rels:
        assert not {"site-packages", "dist-packages"} & set(rel.parts)
        assert not any(part.startswith("config-") for part in rel.parts)
        assert {"test", "tests", "idlelib", "lib2to3", "idle_test", "turtledemo"} & set(rel.parts[:-1])
    prompts = corpus.unseen_prompts(5, 200, seed=1)
    assert len(set(prompts)) == 5 and prompts == corpus.unseen_prompts(5, 200, seed=1)


def test_line_prompts_start_at_new_mid_file_lines():
    """data-fresh's prompts: distinct, full length, each at a non-blank line start that no definition-start
    prompt (cut_prompts, every earlier drafter stage's data) can begin at; deterministic per seed."""
    texts = ["import os\n\ndef f(x):\n    y = x + 1\n    return y\n\n\nclass C:\n    z = f(2)\n" * 3,
             "    async def g():\n        await h()\n# comment line\nvalue = [1, 2, 3]\n" * 3]
    prompts = corpus.line_prompts(texts, 6, 30, seed=3)
    assert len(prompts) == len(set(prompts)) == 6 and prompts == corpus.line_prompts(texts, 6, 30, seed=3)
    definitions = set(corpus.cut_prompts(texts, 100, 30, seed=0))
    for p in prompts:
        assert len(p) == 30 and p.split("\n")[0].strip() and p not in definitions
        assert not p.lstrip().startswith(("def ", "class ", "async def "))
        assert any(t.startswith(p) or ("\n" + p) in t for t in texts)


def test_fresh_prompt_parts_continue_one_draw(tmp_path, monkeypatch):
    """data-fresh, data-fresh2 and data-fresh3 write consecutive parts of one draw: none repeated, ids
    continuing, each part what the stage before it left."""
    from dflash.demo import build

    parts = (("prompts-fresh.jsonl", 40), ("prompts-fresh2.jsonl", 30), ("prompts-fresh3.jsonl", 20))
    monkeypatch.setattr(build, "FRESH_PARTS", parts)
    texts_by_split = {"train": corpus.load_texts("train", max_files=6), "unseen": []}
    monkeypatch.setattr(corpus, "load_texts", lambda split, **_: texts_by_split[split])
    for part in range(len(parts)):
        build.write_fresh_prompts(tmp_path, part)
    records = [json.loads(line) for name, _ in parts for line in (tmp_path / name).read_text().splitlines()]
    assert [r["id"] for r in records] == [f"fresh-{i}" for i in range(90)]
    assert [r["prompt"] for r in records] == corpus.fresh_prompts(90, seed=build.SEED)
    assert len({r["prompt"] for r in records}) == 90


def test_tokenizer_round_trip_and_mask(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = tok.encode(SAMPLE, add_special_tokens=False)
    assert tok.decode(ids) == SAMPLE
    assert tok.mask_token == MASK_TOKEN and tok.mask_token_id is not None
    assert tok.eos_token_id == tok.pad_token_id != tok.mask_token_id
    assert len(tok) == 512


def test_training_lowers_loss(tok_dir, texts, tmp_path):
    metrics = _train(tok_dir, tmp_path, texts, steps=30, lr=1e-2)
    losses = _losses(tmp_path)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert metrics["steps"] == 30 and metrics["heldout_perplexity"] > 1


def test_schedule_is_linear_warmup_then_cosine_to_the_min_ratio(tok_dir, texts, tmp_path):
    """transformers' cosine schedule with a minimum: from the end of warmup on, each step's learning rate is
    what the hand-written schedule it replaced gave (peak, cosine decay to min_lr_ratio of it); warmup rises
    linearly from 0 (the hand-written one started one warmup step further up)."""
    steps, warmup, peak, ratio = 10, 2, 3e-3, 0.1
    _train(tok_dir, tmp_path, texts, steps=steps, warmup=warmup, lr=peak, min_lr_ratio=ratio)
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    for step in range(warmup, steps):  # log line `step` holds the learning rate of scheduler step `step`
        progress = (step - warmup) / (steps - warmup)
        hand_written = ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        assert lrs[step] == pytest.approx(peak * hand_written, rel=1e-12), step
    assert lrs[:warmup + 1] == pytest.approx([0.0, peak / 2, peak])
    assert lrs[6] == pytest.approx(peak * (ratio + (1 - ratio) / 2))  # halfway through the decay


def test_resume_matches_uninterrupted_run(tok_dir, texts, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    _train(tok_dir, full, texts, steps=8)
    # Interrupted at step 5: the checkpoint is from step 3, steps 4-5 are redone.
    assert _train(tok_dir, split, texts, steps=8, stop_after=5) == {}
    _train(tok_dir, split, texts, steps=8)
    assert _losses(split) == _losses(full)


def test_init_from_extends_a_finished_run(tok_dir, texts, tmp_path):
    first, second, fresh = tmp_path / "first", tmp_path / "second", tmp_path / "fresh"
    _train(tok_dir, first, texts, steps=30, lr=1e-2)
    _train(tok_dir, second, texts, steps=2, init_from=first / "final")
    _train(tok_dir, fresh, texts, steps=2)
    # The extension starts where the first run ended, far below a random init.
    assert _losses(second)[0] < _losses(fresh)[0] - 0.3
    assert abs(_losses(second)[0] - sum(_losses(first)[-5:]) / 5) < 0.5
    # Weights of another shape are refused with the field that differs, before any step.
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    wider = demo_model_config(vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                              head_dim=16, intermediate_size=64, max_position_embeddings=128)
    with pytest.raises(CheckpointError, match="no config.json"):
        _train(tok_dir, tmp_path / "bad", texts, steps=2, init_from=tmp_path / "missing")
    with pytest.raises(CheckpointError, match="num_hidden_layers=1 but the flags build num_hidden_layers=2"):
        train_lm(wider, tok_dir, tmp_path / "bad", TrainConfig(steps=2, batch_size=4, seq_len=32),
                 texts=texts, heldout_texts=texts[:1], progress=False, init_from=first / "final")


def test_build_keeps_each_models_best_run_by_its_own_validation_measure(tmp_path):
    """final_dirs: the drafter with the highest last held-out tau, the AR draft with the lowest held-out
    loss; an extension must be strictly better; unfinished runs are not candidates."""
    from dflash.demo.build import final_dirs
    from dflash.errors import DFlashError

    def drafter_run(name, taus, finished=True):
        d = tmp_path / name
        d.mkdir()
        (d / "train_log.jsonl").write_text("".join(
            json.dumps({"event": "eval", "step": i, "tau": t}) + "\n" for i, t in enumerate(taus)))
        if finished:
            (d / "model.safetensors").write_bytes(b"")

    def ar_run(name, loss, finished=True):
        (tmp_path / name / "final").mkdir(parents=True)
        (tmp_path / name / "final" / "config.json").write_text("{}")
        if finished:  # metrics.json is written last
            (tmp_path / name / "metrics.json").write_text(json.dumps({"heldout_loss": loss}))

    with pytest.raises(DFlashError, match="no finished drafter"):
        final_dirs(tmp_path)
    drafter_run("drafter", [2.0, 2.3])
    drafter_run("drafter-extended", [2.9, 2.3])  # the last eval counts, and a tie keeps the first run
    drafter_run("drafter-more", [3.5], finished=False)
    ar_run("ar-draft", 5.0)
    ar_run("ar-draft-extended", 5.3)
    ar_run("ar-draft-more", None, finished=False)
    assert final_dirs(tmp_path) == (tmp_path / "drafter", tmp_path / "ar-draft" / "final")
    (tmp_path / "drafter-more" / "model.safetensors").write_bytes(b"")
    (tmp_path / "ar-draft-more" / "metrics.json").write_text(json.dumps({"heldout_loss": 4.0}))
    assert final_dirs(tmp_path) == (tmp_path / "drafter-more", tmp_path / "ar-draft-more" / "final")


def test_build_lineage_is_what_the_stages_run(tmp_path):
    """The curves and the selection read DRAFTER_LINEAGE / AR_LINEAGE: every run there is a stage's --out, and
    starts from the weights of the parent the lineage names."""
    outputs = {}
    for cmd in stage_commands(tmp_path).values():
        if "train" in cmd or "dflash.demo.pretrain" in cmd:
            outputs[Path(cmd[cmd.index("--out") + 1]).name] = cmd
    # ... and every model a stage trains (but the target) is in a lineage, so the selection sees it
    assert set(outputs) - {"target"} == {run for run, _, _ in DRAFTER_LINEAGE + AR_LINEAGE}
    for run, parent, _ in DRAFTER_LINEAGE + AR_LINEAGE:
        cmd = outputs[run]
        flags = [f for f in ("--init-drafter", "--init-from") if f in cmd]
        if parent is None:
            assert not flags, run
        else:
            assert Path(cmd[cmd.index(flags[0]) + 1]).relative_to(tmp_path).parts[0] == parent, run


def test_restore_seeds_a_lost_work_directory_from_an_installed_pair(tmp_path):
    """`--stages restore`: the installed target, tokenizer, drafter and AR draft land where the later stages
    and the selection look for them; the drafter's held-out tau is measured again with the restored target;
    after install, the runs that are gone keep their recorded measures; what exists is kept."""
    from tiny import char_tokenizer, tiny_drafter, tiny_target

    from dflash.demo.build import _selection, final_dirs, restore
    from dflash.drafter.checkpoint import save_drafter
    from dflash.errors import DFlashError

    src, work = tmp_path / "installed", tmp_path / "work"
    target = tiny_target(layers=3)
    for name, model in (("target", target), ("ar-draft", tiny_target(layers=1, seed=3))):
        model.save_pretrained(src / name)
        char_tokenizer().save_pretrained(src / name)
    save_drafter(tiny_drafter(target, num_layers=1), src / "drafter")
    with pytest.raises(DFlashError, match="no manifest.json"):
        restore(work, src)
    manifest = {"installed": {"drafter": "runs/demo/drafter-fresh", "ar_draft": "runs/demo/ar-draft-fresh2/final"},
                "target_metrics": {"heldout_loss": 3.7}, "ar_draft_metrics": {"heldout_loss": 4.3}}
    (src / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DFlashError, match="lacks 'selection'"):
        restore(work, src)
    manifest["selection"] = {"drafter_heldout_tau": {"drafter-spread": 2.9, "drafter-fresh": 3.1},
                             "ar_draft_heldout_loss": {"ar-draft-fresh": 4.4, "ar-draft-fresh2": 4.3}}
    (src / "manifest.json").write_text(json.dumps(manifest))

    restore(work, src)
    assert (work / "target" / "final" / "model.safetensors").is_file()
    assert json.loads((work / "target" / "metrics.json").read_text()) == {"heldout_loss": 3.7}
    assert AutoTokenizer.from_pretrained(str(work / "tokenizer")).mask_token == "<|MASK|>"
    assert len((work / "heldout.jsonl").read_text().splitlines()) == 24
    (event,) = [json.loads(line) for line in (work / "drafter-fresh" / "train_log.jsonl").read_text().splitlines()]
    assert event["event"] == "eval" and event["rounds"] > 0 and event["tau"] >= 1.0
    assert final_dirs(work) == (work / "drafter-fresh", work / "ar-draft-fresh2" / "final")
    selection = _selection(work)
    assert selection["drafter_heldout_tau"] == {"drafter-spread": 2.9, "drafter-fresh": event["tau"]}  # measured again
    assert selection["ar_draft_heldout_loss"] == {"ar-draft-fresh": 4.4, "ar-draft-fresh2": 4.3}
    assert selection["restored_from"] == manifest["installed"]

    log = (work / "drafter-fresh" / "train_log.jsonl").read_text() + json.dumps({"event": "eval", "tau": 9.0}) + "\n"
    (work / "drafter-fresh" / "train_log.jsonl").write_text(log)
    restore(work, src)  # a second restore keeps what is there
    assert (work / "drafter-fresh" / "train_log.jsonl").read_text() == log
