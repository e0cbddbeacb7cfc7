"""Speculative output equals the target's own output, token for token (tiny real models, fp32)."""

import pytest
from dflash.engine import SpeculativeEngine
from dflash.params import SamplingParams
from dflash.target import TargetModel
from tiny import (
    FULL,
    TargetDistributionDrafter,
    char_tokenizer,
    engine_for,
    hf_greedy,
    oracle_engine,
    prompts,
    tiny_drafter,
    tiny_target,
)

FAMILIES = ["qwen3", "llama"]
BLOCK_SIZES = [2, 3, 4, 8, 16]
N_NEW = 48


@pytest.fixture(scope="module", params=FAMILIES)
def target(request):
    return tiny_target(request.param)


@pytest.fixture(scope="module")
def references(target):
    """The target's own greedy continuation of each prompt, from transformers' generate."""
    return {tuple(p): hf_greedy(target, p, N_NEW) for p in prompts(8)}


def test_block_size_one_equals_transformers_generate(target, references):
    engine = engine_for(target)
    for prompt, expected in references.items():
        got = engine.run(list(prompt), SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))
        assert got.token_ids == expected
        assert got.stats.tau == 1.0


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_dflash_drafter_greedy_equals_target(target, references, block_size):
    engine = engine_for(target, tiny_drafter(target, block_size=16))
    for prompt, expected in references.items():
        got = engine.run(list(prompt), SamplingParams(max_new_tokens=N_NEW, block_size=block_size, ignore_eos=True))
        assert got.token_ids == expected


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_accepting_drafter_greedy_equals_target(target, references, block_size):
    """With a drafter that is often right, whole blocks are accepted and the output still matches."""
    taus = []
    for prompt, expected in references.items():
        engine = oracle_engine(target, list(prompt), expected, error_rate=0.15)
        got = engine.run(list(prompt), SamplingParams(max_new_tokens=N_NEW, block_size=block_size, ignore_eos=True))
        assert got.token_ids == expected
        taus.append(got.stats.tau)
        assert got.stats.rounds == sum(got.stats.acceptance_histogram.values())
    if block_size > 2:
        assert sum(taus) / len(taus) > 2.0  # acceptance really happened


def test_sliding_window_drafter_is_lossless(target, references):
    drafter = tiny_drafter(target, num_layers=2)
    raw = dict(drafter.config.raw, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    from dflash.drafter import DFlashConfig, DFlashDraftModel

    sliding = DFlashDraftModel(DFlashConfig.from_dict(raw)).eval()
    engine = engine_for(target, sliding)
    for prompt, expected in list(references.items())[:3]:
        assert engine.run(list(prompt), SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)).token_ids == expected


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_sampled_output_is_the_same_at_every_block_size(target, block_size):
    """Position-seeded sampling: speculative and target-only runs with one seed write the same tokens."""
    for i, prompt in enumerate(prompts(3, seed=5)):
        for params in (
            dict(temperature=1.0),
            dict(temperature=0.7, top_k=5),
            dict(temperature=1.3, top_p=0.8),
        ):
            base = SamplingParams(max_new_tokens=32, seed=i, ignore_eos=True, block_size=1, **params)
            expected = engine_for(target).run(prompt, base).token_ids
            spec = SamplingParams(max_new_tokens=32, seed=i, ignore_eos=True, block_size=block_size, **params)
            got = oracle_engine(target, prompt, expected, error_rate=0.1).run(prompt, spec)
            assert got.token_ids == expected


def test_max_new_tokens_is_exact_even_inside_an_accepted_block(target, references):
    for prompt, expected in references.items():
        for n in (1, 2, 5, 17):
            got = oracle_engine(target, list(prompt), expected, error_rate=0.0).run(
                list(prompt), SamplingParams(max_new_tokens=n, ignore_eos=True)
            )
            assert got.token_ids == expected[:n] and got.finish_reason == "length"


def test_stop_token_inside_an_accepted_block(target, references):
    checked = 0
    for prompt, expected in references.items():
        # A token whose first appearance is late enough to sit inside an accepted block.
        late = [k for k in range(6, len(expected)) if expected[k] not in expected[:k]]
        if not late:
            continue
        stop = expected[late[0]]
        got = oracle_engine(target, list(prompt), expected, error_rate=0.0).run(
            list(prompt), SamplingParams(max_new_tokens=N_NEW, stop_token_ids=(stop,), ignore_eos=True)
        )
        assert got.token_ids == expected[: late[0] + 1]
        assert got.finish_reason == "stop"
        assert max(got.stats.acceptance_histogram) > 2
        checked += 1
    assert checked >= 3


def test_eos_stops_unless_ignored(target, references):
    prompt, expected = next(iter(references.items()))
    eos = expected[5]
    engine = oracle_engine(target, list(prompt), expected, error_rate=0.0, eos=(eos,))
    got = engine.run(list(prompt), SamplingParams(max_new_tokens=N_NEW))
    assert got.token_ids == expected[: expected.index(eos) + 1]


def test_stop_string_inside_an_accepted_block(target, references):
    tok = char_tokenizer()
    for prompt, expected in list(references.items())[:4]:
        text = tok.decode(expected)
        stop = text[12:14]
        cut = text.index(stop)
        engine = oracle_engine(target, list(prompt), expected, error_rate=0.0, tokenizer=tok)
        pieces, tokens, finish = [], [], None
        for r in engine.generate(list(prompt), SamplingParams(max_new_tokens=N_NEW, stop=(stop,), ignore_eos=True)):
            pieces.append(r.text)
            tokens += r.token_ids
            finish = r.finish_reason
        assert "".join(pieces) == text[:cut]
        assert tokens == expected[: cut + len(stop)]  # one token per character: up to the stop's last token
        assert finish == "stop"


def test_streaming_yields_each_round_with_its_statistics(target, references):
    prompt, expected = next(iter(references.items()))
    engine = oracle_engine(target, list(prompt), expected, error_rate=0.2)
    rounds = list(engine.generate(list(prompt), SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)))
    assert rounds[0].stats.index == 0 and len(rounds[0].token_ids) == 1
    assert [t for r in rounds for t in r.token_ids] == expected
    for r in rounds[1:]:
        assert r.stats.committed == r.stats.accepted_tokens + 1
        room = N_NEW - sum(len(x.token_ids) for x in rounds[: r.stats.index])
        assert r.stats.draft_tokens == min(15, room - 1)
        assert r.stats.verify_ms > 0
    totals = rounds[-1].totals
    assert totals.generated_tokens == N_NEW and totals.ttft_s > 0
    assert totals.tau == pytest.approx(sum(r.stats.committed for r in rounds[1:]) / (len(rounds) - 1))


def test_context_limit_finishes_with_length():
    """max_new_tokens unset fills the room the context leaves (a value beyond it is refused: intake.py)."""
    model = tiny_target("qwen3", max_positions=40)
    prompt = prompts(1, seed=3, lo=30, hi=31)[0]
    expected = hf_greedy(model, prompt, 10)
    got = oracle_engine(model, prompt, expected + [0] * 16, error_rate=0.0).run(
        prompt, SamplingParams(ignore_eos=True))
    assert got.finish_reason == "length"
    assert len(prompt) + len(got.token_ids) == 40
    assert got.token_ids == expected


def test_resume_from_committed_tokens_continues_exactly(target, references):
    """Caches lost mid-request: re-prefill from the committed tokens gives exactly the rest."""
    for prompt, expected in list(references.items())[:3]:
        for cut in (1, 7, 20):
            engine = oracle_engine(target, list(prompt), expected, error_rate=0.2)
            rest = engine.run(list(prompt), SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))
            resumed = oracle_engine(target, list(prompt), expected, error_rate=0.2)
            rounds = list(resumed.generate(list(prompt), SamplingParams(max_new_tokens=N_NEW, ignore_eos=True),
                                           committed_ids=expected[:cut]))
            assert [t for r in rounds for t in r.token_ids] == expected[cut:] == rest.token_ids[cut:]
    prompt = prompts(1, seed=9)[0]
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=11, ignore_eos=True)
    full = engine_for(target).run(prompt, params).token_ids
    rest = [t for r in engine_for(target).generate(prompt, params, committed_ids=full[:12]) for t in r.token_ids]
    assert rest == full[12:]


@pytest.mark.parametrize("confidence", [0.05, 0.5, 0.99])
def test_confidence_cut_drafts_are_lossless(target, references, confidence):
    """draft_confidence shortens drafts (a real drafter's cut, and random cuts) without changing the output."""
    engine = engine_for(target, tiny_drafter(target, block_size=16))
    for prompt, expected in list(references.items())[:4]:
        params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, draft_confidence=confidence)
        got = engine.run(list(prompt), params)
        assert got.token_ids == expected
        whole = engine.run(list(prompt), SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))
        # an untrained drafter is never that sure: the cut verifies fewer tokens per round
        assert got.stats.draft_tokens / got.stats.rounds < whole.stats.draft_tokens / whole.stats.rounds
        cut = oracle_engine(target, list(prompt), expected, error_rate=0.1).run(list(prompt), params)
        assert cut.token_ids == expected
    for i, prompt in enumerate(prompts(2, seed=7)):
        base = SamplingParams(max_new_tokens=32, seed=i, ignore_eos=True, temperature=1.0, block_size=1)
        expected = engine_for(target).run(prompt, base).token_ids
        sampled = SamplingParams(max_new_tokens=32, seed=i, ignore_eos=True, temperature=1.0,
                                 draft_confidence=confidence)
        assert engine.run(prompt, sampled).token_ids == expected


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (1.6, 20, 0.9)])
def test_coupled_proposals_of_the_targets_distribution_are_always_accepted(target, temperature, top_k, top_p):
    """A drafter whose distribution is the target's, picking with the round's DraftSampling (the
    target's own Gumbel noise per position), proposes exactly what the target then samples: every
    draft is accepted at any temperature. Picking its argmax instead, it is accepted only where the
    target's sample happens to be its argmax. Either way the output is the target-only output."""
    prompt = prompts(1, seed=5)[0]
    params = SamplingParams(max_new_tokens=40, seed=3, ignore_eos=True, temperature=temperature, top_k=top_k,
                            top_p=top_p)
    expected = engine_for(target).run(prompt, params).token_ids
    taus = {}
    for argmax_only in (False, True):
        drafter = TargetDistributionDrafter(target, prompt, expected, block_size=8, argmax_only=argmax_only)
        got = SpeculativeEngine(TargetModel(target, (0,)), drafter, config=FULL).run(prompt, params)
        assert got.token_ids == expected
        taus[argmax_only] = got.stats.tau
        if not argmax_only:  # 39 tokens after the prefill's first: 8 per round, the last round 7
            assert got.stats.rounds == 5, got.stats.acceptance_histogram
    assert taus[False] > taus[True] + 1.0, taus


def test_a_smaller_block_verifies_the_first_proposals_of_the_trained_block(target, references):
    """block_size 8 with a block-16 drafter: the drafter still fills its trained block of 16 (a block of
    8, fewer mask slots to attend to, is a layout it never saw), and the round verifies its first 7."""
    drafter_model = tiny_drafter(target, block_size=16)
    engine = engine_for(target, drafter_model)
    drafter, calls = engine.drafter, []
    real_draft = drafter.draft

    def spy(*args, **kwargs):
        out = real_draft(*args, **kwargs)
        calls.append((args[4], out))
        return out

    drafter.draft = spy
    prompt, expected = next(iter(references.items()))
    verified, tokens = [], []
    for r in engine.generate(list(prompt), SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, block_size=8)):
        verified.append(r.stats.draft_tokens)
        tokens += r.token_ids
    assert tokens == expected
    rounds = len(verified) - 1  # the prefill drafts nothing
    assert rounds > 0 and all(size == 16 for size, _ in calls[:rounds])
    assert all(len(out) == 15 for _, out in calls[:rounds]) and max(verified[1:]) == 7
