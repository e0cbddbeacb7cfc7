"""Acceptance length of the demo pair on held-out modules, beside the same-budget autoregressive draft.

tau is committed tokens per target verify forward (bonus included). For DFlash it comes from the
engine's own statistics; for the autoregressive draft model it comes from transformers' assisted
generation, counting the target's forward passes with a hook (in assisted decoding every pass,
the first included, verifies one drafted run of tokens and commits the accepted ones plus one).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from ..loading import build_engine
from ..params import SamplingParams
from ..scheduler import SchedulerConfig

DRAFT_CONFIDENCE = 0.05  # also measured: block 16 with drafts cut at this joint confidence
AR_DRAFT_TOKENS = 15  # the AR draft proposes as many tokens a round as a block of 16 holds drafts


def evaluate_pair(target_dir: str | Path, drafter_dir: str | Path, ar_draft_dir: str | Path, prompts: list[str],
                  max_new_tokens: int) -> list[dict]:
    """One row per method at T=0 and T=1: DFlash block 16 and 8, block 16 with confidence-cut drafts, and
    assisted generation with the AR draft; printed as they come."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    rows = []
    for temperature in (0.0, 1.0):
        for block, confidence in ((16, 0.0), (8, 0.0), (16, DRAFT_CONFIDENCE)):
            rows.append(dflash_tau(target_dir, drafter_dir, prompts, block, temperature, max_new_tokens, confidence))
            print(json.dumps(rows[-1]), flush=True)
        rows.append(assisted_tau(target_dir, ar_draft_dir, tokenizer, prompts, AR_DRAFT_TOKENS, temperature,
                                 max_new_tokens))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def dflash_tau(target_dir: str | Path, drafter_dir: str | Path, prompts: list[str], block_size: int, temperature: float,
               max_new_tokens: int, draft_confidence: float = 0.0) -> dict:
    # Every round verifies the whole block (or the confidence-cut draft): tau measures the drafter, not the
    # engine's choice of how many proposals pay on this machine.
    engine = build_engine(target_dir, drafter_dir, device="cpu", dtype="float32",
                          scheduler=SchedulerConfig(verify_policy="full"))
    rounds = committed = verified = 0
    hist: dict[int, int] = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=i,
                                block_size=block_size, draft_confidence=draft_confidence)
        stats = engine.run(engine.encode(prompt), params).stats
        rounds += stats.rounds
        verified += stats.draft_tokens + stats.rounds
        for k, n in stats.acceptance_histogram.items():
            hist[k] = hist.get(k, 0) + n
            committed += k * n
    method = "dflash" if not draft_confidence else f"dflash-confidence-{draft_confidence:g}"
    return {"method": method, "block_size": block_size, "temperature": temperature,
            "tau": round(committed / max(rounds, 1), 3), "rounds": rounds,
            "verified_per_round": round(verified / max(rounds, 1), 3),
            "acceptance_histogram": {str(k): v for k, v in sorted(hist.items())}}


@torch.inference_mode()
def assisted_tau(target_dir: str | Path, draft_dir: str | Path, tokenizer: PreTrainedTokenizerBase,
                 prompts: list[str], num_assistant_tokens: int, temperature: float, max_new_tokens: int) -> dict:
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    calls = [0]
    hook = target.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    verify_passes = generated = 0
    try:
        for i, prompt in enumerate(prompts):
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
            calls[0] = 0
            torch.manual_seed(i)
            out = target.generate(
                **ids, assistant_model=draft, max_new_tokens=max_new_tokens,
                do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                top_k=0 if temperature > 0 else None, top_p=None,
                num_assistant_tokens=num_assistant_tokens, num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=0.0, pad_token_id=tokenizer.pad_token_id,
            )
            generated += out.shape[1] - ids["input_ids"].shape[1]
            verify_passes += calls[0]
    finally:
        hook.remove()
    return {"method": "autoregressive-draft (transformers assisted generation)",
            "block_size": num_assistant_tokens + 1, "temperature": temperature,
            "tau": round(generated / max(verify_passes, 1), 3), "rounds": verify_passes}
