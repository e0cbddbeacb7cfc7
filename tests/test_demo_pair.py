"""The committed demo pair: it loads, it is lossless, and its manifest tells how it was made."""

import json

import pytest

from dflash.defaults import DEMO_AR_DRAFT, DEMO_DIR, demo_pair
from dflash.demo.corpus import heldout_prompts
from dflash.loading import build_engine
from dflash.params import SamplingParams


@pytest.fixture(scope="module")
def engines():
    target, drafter = demo_pair()
    return build_engine(target, drafter, device="cpu"), build_engine(target, None, device="cpu")


def test_demo_pair_is_lossless_on_heldout_prompts(engines):
    spec, alone = engines
    taus = []
    for prompt in heldout_prompts(4, seed=1):
        ids = spec.encode(prompt)
        for params in (SamplingParams(max_new_tokens=64), SamplingParams(max_new_tokens=48, temperature=1.0, seed=3)):
            got = spec.run(ids, params)
            assert got.token_ids == alone.run(ids, params).token_ids
            assert got.text == alone.run(ids, params).text
        taus.append(got.stats.tau)
    assert max(taus) > 1.0  # the trained drafter is accepted at least sometimes


def test_manifest_records_commands_seeds_and_measured_tau():
    manifest = json.loads((DEMO_DIR / "manifest.json").read_text())
    assert set(manifest["commands"]) >= {"tokenizer", "target", "drafter", "ar-draft"}
    assert manifest["seed"] == 0
    taus = {(r["method"].split()[0], r["block_size"], r["temperature"]): r["tau"] for r in manifest["eval"]["results"]}
    assert ("dflash", 16, 0.0) in taus and ("dflash", 8, 1.0) in taus
    assert (DEMO_DIR / "training_curves.png").is_file()
    assert (DEMO_AR_DRAFT / "config.json").is_file()
