"""Sampled speculative output follows the target's distribution exactly (chi-square against exact probabilities)."""


import dflash.engine
import pytest
import torch
from dflash.drafter.protocol import DraftSampling
from dflash.errors import DFlashError
from dflash.params import SamplingParams
from dflash.rounds import accept_length
from dflash.sampling import filter_logits, propose_tokens, sample_tokens
from scipy.stats import chisquare
from tiny import hf_greedy, oracle_engine, tiny_target

PROMPT = [5, 17, 3, 42, 8]
PARAMS = dict(temperature=1.5, top_k=3, max_new_tokens=3, ignore_eos=True, block_size=4)
RUNS = 1200


@torch.no_grad()
def exact_joint(model) -> dict[tuple[int, int, int], float]:
    """P(x1, x2, x3) under the filtered target distribution, by enumeration (top_k=3: 27 outcomes)."""
    params = SamplingParams(**PARAMS)

    def dist(seq):
        probs = filter_logits(model(torch.tensor([seq])).logits[0, -1:], params).exp()[0]
        return {int(t): float(probs[t]) for t in torch.nonzero(probs).flatten()}

    joint = {}
    for x1, p1 in dist(PROMPT).items():
        for x2, p2 in dist(PROMPT + [x1]).items():
            for x3, p3 in dist(PROMPT + [x1, x2]).items():
                joint[(x1, x2, x3)] = p1 * p2 * p3
    return joint


def sample_counts(model, script) -> dict[tuple[int, ...], int]:
    counts = {}
    for seed in range(RUNS):
        # The drafter always proposes the greedy continuation: often accepted, never a sample itself.
        engine = oracle_engine(model, PROMPT, script, error_rate=0.0)
        out = tuple(engine.run(PROMPT, SamplingParams(seed=seed, **PARAMS)).token_ids)
        counts[out] = counts.get(out, 0) + 1
    return counts


def p_value(joint, counts) -> float:
    """Chi-square p-value of the counts against the exact joint; 0 when a count falls outside its support."""
    if not set(counts) <= set(joint):
        return 0.0  # sampled a sequence the filtered target cannot produce
    keys = sorted(joint)
    observed = [counts.get(k, 0) for k in keys]
    total = sum(joint.values())
    expected = [joint[k] / total * sum(observed) for k in keys]
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module")
def model_and_script():
    model = tiny_target("qwen3", seed=3)
    # Flatten the logits so all three top-k candidates are likely and the test has power.
    with torch.no_grad():
        model.lm_head.weight.mul_(0.1)
    return model, hf_greedy(model, PROMPT, 8)


def test_speculative_sampling_matches_target_distribution(model_and_script):
    model, script = model_and_script
    assert p_value(exact_joint(model), sample_counts(model, script)) > 1e-3


def test_the_test_catches_an_off_by_one_acceptance_rule(model_and_script, monkeypatch):
    """Accepting one draft token more than the target agreed with biases the output; the test sees it."""
    model, script = model_and_script
    monkeypatch.setattr(dflash.engine, "accept_length", lambda d, p: min(accept_length(d, p) + 1, len(d)))
    assert p_value(exact_joint(model), sample_counts(model, script)) < 1e-6


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (2.0, 9, 0.6)])
def test_coupled_proposals_are_the_targets_samples_for_the_same_logits(temperature, top_k, top_p):
    """propose_tokens with the request's DraftSampling picks, from the same logits, exactly the tokens
    sample_tokens draws at every position (the coupling a drafter relies on); a greedy rule picks argmax."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(4)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=21)
    rule = DraftSampling.for_request(params, 21)
    for first in (0, 17, 4000):
        tokens, probs = propose_tokens(logits, rule, first, with_probs=True)
        assert torch.equal(tokens, sample_tokens(logits, params, 21, first))
        assert torch.allclose(probs, filter_logits(logits, params).exp().gather(-1, tokens[:, None])[:, 0])
    shifted, _ = propose_tokens(logits, rule, 1)
    assert not torch.equal(shifted, sample_tokens(logits, params, 21, 0))  # positions matter
    greedy, top = propose_tokens(logits, DraftSampling(), 0, with_probs=True)
    assert torch.equal(greedy, logits.argmax(-1)) and torch.allclose(top, logits.softmax(-1).max(-1).values)


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("temperature", float("nan")), ("top_k", -1),
                                          ("top_p", 0.0), ("seed", -1), ("seed", 1 << 64), ("min_confidence", 1.0)])
def test_draft_sampling_names_a_bad_field(field, value):
    base = dict(temperature=1.0)
    with pytest.raises(DFlashError, match=f"^{field}: "):
        DraftSampling(**{**base, field: value})
    assert DraftSampling(temperature=0.0, top_p=0.0).greedy  # top_p is not read when greedy
