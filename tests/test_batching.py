"""Continuous batching: many sessions per step give each exactly its solo output and solo acceptance.

Tiny real Qwen3 and Llama targets with random DFlash drafters, fp32, and the committed demo pair (a
trained drafter, where a mask or position leaking across sessions would show as lost acceptance).
"""

import contextlib
import threading

import pytest
import torch
from dflash.defaults import demo_pair
from dflash.demo.corpus import heldout_prompts
from dflash.errors import InvalidRequestError
from dflash.loading import build_engine
from dflash.params import SamplingParams
from dflash.scheduler import QueueFullError, SchedulerConfig
from dflash.verify_policy import (
    CostCurve,
    DraftCost,
    StepCalibration,
    choose_drafted,
    choose_verify_lengths,
    fit_step_time,
)
from tiny import char_tokenizer, engine_for, prompts, tiny_drafter, tiny_target


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request):
    target = tiny_target(request.param)
    return target, tiny_drafter(target)


def mixed_requests(n: int):
    """Different prompt lengths, budgets, temperatures, stops and seeds."""
    out = []
    for i, prompt in enumerate(prompts(n, seed=11, lo=3, hi=60)):
        params = SamplingParams(
            max_new_tokens=8 + 7 * (i % 5), temperature=(0.0, 0.8, 1.3)[i % 3], top_p=(1.0, 0.9)[i % 2],
            seed=100 + i, stop=("e",) if i % 4 == 1 else (), ignore_eos=i % 2 == 0, block_size=(None, 4, 16, 1)[i % 4],
        )
        out.append((prompt, params))
    return out


def run_together(engine, requests, starts):
    """Submit request i at step starts[i]; step until all are done; each request's rounds."""
    gens, rounds, step = {}, {i: [] for i in range(len(requests))}, 0
    while len(gens) < len(requests) or any(not g.done or g.outbox for g in gens.values()):
        for i, (prompt, params) in enumerate(requests):
            if starts[i] == step:
                gens[i] = engine.start(prompt, params, request_id=f"r{i}")
                engine.submit(gens[i])
        engine.step()
        for i, g in gens.items():
            while g.outbox:
                rounds[i].append(g.outbox.popleft())
        step += 1
        assert step < 5000
    return rounds


class StepSizes:
    """A StepObserver that records how many sessions each step served."""

    def __init__(self):
        self.rounds = []

    def step_scope(self):
        return contextlib.nullcontext()

    def on_step(self, report):
        self.rounds.append(len(report.rounds))


def tokens(rounds):
    return [t for r in rounds for t in r.token_ids]


@pytest.mark.parametrize("policy", ["full", "adaptive"])
def test_eight_mixed_requests_each_get_their_solo_output(pair, policy):
    target, drafter = pair
    requests = mixed_requests(8)
    solo = [engine_for(target, drafter, char_tokenizer()).run(p, params) for p, params in requests]
    engine = engine_for(target, drafter, char_tokenizer(), config=SchedulerConfig(verify_policy=policy))
    together = run_together(engine, requests, starts=[0, 0, 1, 3, 3, 5, 9, 14])
    for i, want in enumerate(solo):
        assert tokens(together[i]) == want.token_ids, i
        assert "".join(r.text for r in together[i]) == want.text
        assert together[i][-1].finish_reason == want.finish_reason
    assert engine.cache.num_sessions == 0 and engine.cache.reserved_tokens == 0 and engine.cache.allocated_bytes == 0
    assert engine.drafter.num_sessions == 0


def test_sixteen_sessions_keep_their_solo_acceptance_lengths(pair):
    """Lossless is not enough: a drafter batching bug (a context row or mask across sessions) keeps the
    output exact and silently lowers acceptance. With every proposal verified, each session's per-round
    acceptance under batching must equal its solo run's."""
    target, drafter = pair
    requests = [(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in prompts(16, seed=3, lo=5, hi=80)]
    solo = [[r.stats.accepted_tokens for r in engine_for(target, drafter).generate(p, params)]
            for p, params in requests]
    together = run_together(engine_for(target, drafter), requests, starts=[i // 4 for i in range(16)])
    assert [[r.stats.accepted_tokens for r in together[i]] for i in range(16)] == solo
    assert sum(map(sum, solo)) > 0  # some proposals accepted, so the comparison means something


def test_demo_pair_acceptance_is_the_same_batched():
    target_dir, drafter_dir = demo_pair()
    engine = build_engine(target_dir, drafter_dir, device="cpu", scheduler=SchedulerConfig(verify_policy="full"))
    requests = [(engine.encode(p), SamplingParams(max_new_tokens=48, ignore_eos=True))
                for p in heldout_prompts(16, seed=4)]
    solo = [[r.stats.accepted_tokens for r in engine.generate(p, params)] for p, params in requests]
    together = run_together(engine, requests, starts=[0] * 8 + [2] * 8)
    assert [[r.stats.accepted_tokens for r in together[i]] for i in range(16)] == solo
    assert sum(map(sum, solo)) / sum(map(len, solo)) > 1.0  # the trained drafter is accepted


def test_concurrent_streams_batch_into_shared_steps(pair):
    """Eight threads streaming at once (as the service's handlers do) share steps and get solo output."""
    target, drafter = pair
    requests = mixed_requests(8)
    solo = [engine_for(target, drafter, char_tokenizer()).run(p, params).token_ids for p, params in requests]
    engine = engine_for(target, drafter, char_tokenizer())
    engine.observer = sizes = StepSizes()
    got = {}

    def client(i):
        got[i] = [t for r in engine.generate(*requests[i]) for t in r.token_ids]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(8)] == solo
    assert max(sizes.rounds) > 1  # steps really were shared
    assert engine.cache.num_sessions == 0


def test_stream_interval_sends_fewer_larger_batches_and_the_same_tokens(pair):
    """With the step loop running, a stream gets its first token at once, then what is ready at most
    every `stream_interval_ms`, and its end: each of 8 requests streamed at once (mixed lengths,
    temperatures, stops; one with its own interval 0) gets exactly its solo output, in fewer batches."""
    target, drafter = pair
    requests = [(p, SamplingParams(max_new_tokens=40, ignore_eos=True, block_size=b))
                for p, b in zip(prompts(4, seed=21), (None, 1, 4, None))] + mixed_requests(4)
    solo = [engine_for(target, drafter, char_tokenizer()).run(*r).token_ids for r in requests]
    got = {}
    for interval_ms in (0, 40):
        config = SchedulerConfig(verify_policy="full", stream_interval_ms=interval_ms)
        engine = engine_for(target, drafter, char_tokenizer(), config=config)
        engine.start_loop()
        gens = [engine.start(p, params, stream_interval_ms=0 if i == 7 else None)
                for i, (p, params) in enumerate(requests)]
        batches: dict[int, list] = {}

        def read(i: int, gen, engine=engine, batches=batches) -> None:
            batches[i] = list(engine.stream_batches(gen))

        readers = [threading.Thread(target=read, args=(i, g)) for i, g in enumerate(gens)]
        for g, reader in zip(gens, readers):
            engine.submit(g)
            reader.start()
        for reader in readers:
            reader.join(120)
        tokens_of = [[t for batch in batches[i] for r in batch for t in r.token_ids] for i in range(len(gens))]
        assert tokens_of == solo
        assert all(batches[i][0][0].token_ids for i in range(len(gens)))  # the first token alone, at once
        assert all(len(batches[i][0]) == 1 for i in range(len(gens)))
        got[interval_ms] = [len(batches[i]) for i in range(len(gens))]
    assert sum(got[40][:7]) < sum(got[0][:7])


def test_a_stream_is_woken_for_its_first_token_its_end_and_then_once_per_interval():
    """Generation.worth_streaming, the engine's rule at the end of every step."""
    from dflash.generation import Generation, RoundOutput
    from dflash.stats import GenerationStats, RoundStats

    gen = Generation("r", [1, 2], SamplingParams(max_new_tokens=8), 1, frozenset())
    assert not gen.worth_streaming(0.0, 0.05)  # nothing to send
    gen.outbox.append(RoundOutput([3], "", RoundStats(0, 0, 0, 1, 0, 0.0, 1.0), GenerationStats()))
    assert gen.worth_streaming(0.0, 0.05)  # its first output: at once
    gen.woken_at = 10.0
    gen.outbox.append(RoundOutput([4], "", RoundStats(1, 0, 0, 1, 0, 0.0, 1.0), GenerationStats()))
    assert not gen.worth_streaming(10.04, 0.05) and gen.worth_streaming(10.05, 0.05)
    gen.stream_interval_s = 0.0  # the request's own interval wins over the engine's
    assert gen.worth_streaming(10.001, 0.05)
    gen.stream_interval_s, gen.finish_reason = None, "length"
    assert gen.worth_streaming(10.001, 0.05)  # its end: at once
    assert [r.token_ids for r in gen.take_ready()] == [[3], [4]] and not gen.outbox


def test_a_request_stream_interval_out_of_range_is_refused_naming_the_field(pair):
    target, drafter = pair
    engine = engine_for(target, drafter, char_tokenizer())
    with pytest.raises(InvalidRequestError, match="stream_interval_ms: must be between 0 and 10000"):
        engine.start(prompts(1)[0], SamplingParams(max_new_tokens=4), stream_interval_ms=20_000)


def test_a_drafted_rounds_verify_estimate_follows_what_was_verified():
    """The drafting decision credits a session with the proposals its drafted rounds really verify
    (the verify policy cuts blocks where confidence falls), not with a whole block."""
    from dflash.generation import Generation

    gen = Generation.__new__(Generation)
    gen.verified_ema, gen.drafted_ema = 0.0, 0.0
    assert gen.verify_estimate(15) == 15  # nothing known yet: the whole block
    for _ in range(20):
        gen.verified_ema, gen.drafted_ema = 0.8 * gen.verified_ema + 3, 0.8 * gen.drafted_ema + 1
    assert gen.verify_estimate(15) == 3 and gen.verify_estimate(2) == 2
    for _ in range(20):
        gen.verified_ema, gen.drafted_ema = 0.8 * gen.verified_ema + 0, 0.8 * gen.drafted_ema + 1
    assert gen.verify_estimate(15) == 1  # never 0: the session can still be explored


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(pair):
    target, drafter = pair
    short = (prompts(1, seed=1)[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    long = (prompts(1, seed=2, lo=300, hi=301)[0], SamplingParams(max_new_tokens=5, ignore_eos=True))
    engine = engine_for(target, drafter, config=SchedulerConfig(verify_policy="full", max_step_tokens=64))
    together = run_together(engine, [short, long], starts=[0, 2])
    want = [engine_for(target, drafter).run(*r).token_ids for r in (short, long)]
    assert [tokens(together[0]), tokens(together[1])] == want
    # The long prompt needs 300 / (64 - 16) > 6 steps of prefill; the short stream got a round in each.
    assert len(together[0]) >= 8


def test_cache_budget_admits_what_fits_and_the_queue_is_bounded(pair):
    target, drafter = pair
    prompt = prompts(1, seed=5, lo=20, hi=21)[0]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    need = len(prompt) + 20 + drafter.config.block_size
    config = SchedulerConfig(verify_policy="full", cache_tokens=2 * need, max_queued=2)
    engine = engine_for(target, drafter, config=config)
    gens = [engine.start(prompt, params, request_id=f"g{i}") for i in range(4)]
    for g in gens[:3]:
        engine.submit(g)
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1  # the third waits for room
    engine.submit(gens[3])
    with pytest.raises(QueueFullError, match="max_queued"):
        engine.submit(engine.start(prompt, params))
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        engine.submit(engine.start(prompt * 3, SamplingParams(max_new_tokens=200)))
    while any(not g.done for g in gens):
        engine.step()
        assert engine.cache.reserved_tokens <= config.cache_tokens
    want = engine_for(target, drafter).run(prompt, params).token_ids
    assert all([t for r in g.outbox for t in r.token_ids] == want for g in gens)
    assert engine.cache.reserved_tokens == 0 and engine.cache.allocated_bytes == 0


def test_a_cancelled_stream_frees_its_cache_and_the_others_go_on(pair):
    target, drafter = pair
    engine = engine_for(target, drafter)
    requests = [(p, SamplingParams(max_new_tokens=30, ignore_eos=True)) for p in prompts(3, seed=8)]
    streams = [engine.generate(*r) for r in requests]
    next(streams[0]), next(streams[1]), next(streams[2])
    streams[1].close()
    assert engine.cache.num_sessions == 2
    rest = [[t for r in s for t in r.token_ids] for s in (streams[0], streams[2])]
    want = [engine_for(target, drafter).run(*requests[i]).token_ids for i in (0, 2)]
    assert [w[len(w) - len(r):] for w, r in zip(want, rest)] == rest and all(rest)
    assert engine.cache.num_sessions == 0 and engine.drafter.num_sessions == 0


def test_verify_lengths_follow_confidence_and_cost():
    probs = [torch.tensor([0.9, 0.9, 0.9]), torch.tensor([0.2, 0.9]), torch.empty(0)]
    assert choose_verify_lengths(probs, 3, CostCurve.flat()) == [3, 2, 0]
    steep = CostCurve((1, 2, 64), (10.0, 20.0, 640.0))  # every token costs as much as a whole step
    assert choose_verify_lengths(probs, 3, steep) == [0, 0, 0]
    mid = CostCurve((1, 8, 64), (10.0, 11.0, 40.0))
    lengths = choose_verify_lengths(probs, 3, mid)
    assert lengths[0] >= lengths[1] and lengths[0] > 0


def test_cost_curve_interpolates_and_never_decreases():
    curve = CostCurve((1, 4, 16), (2.0, 1.0, 5.0))
    assert curve.ms == (2.0, 2.0, 5.0)
    assert curve(1) == 2.0 and curve(10) == pytest.approx(3.5) and curve(32) == pytest.approx(9.0)


def test_draft_cost_keeps_the_median_recent_call_per_bucket():
    cost = DraftCost(window=3)
    assert cost(4) == 0.0  # nothing timed yet: drafting is assumed free until it has been measured
    cost.observe(1, 20.0)  # a first call's warm-up
    cost.observe(1, 5.0)
    cost.observe(3, 9.0)  # bucket 4, scaled to 12 ms
    assert cost(1) == 5.0 and cost(4) == pytest.approx(12.0)
    for _ in range(3):
        cost.observe(1, 7.0)
    assert cost(1) == 7.0  # the window moved on: a real slow-down is followed


def test_drafting_stops_where_it_cannot_pay_and_goes_on_where_it_does():
    cheap_verify = CostCurve((1, 16, 64), (10.0, 11.0, 14.0))
    assert choose_drafted([0.9, 0.1], [15, 15], 2, cheap_verify, DraftCost()) == [True, True]
    slow_drafter = DraftCost()
    slow_drafter.observe(1, 60.0)
    slow_drafter.observe(2, 120.0)
    assert choose_drafted([0.9, 0.1], [15, 15], 2, cheap_verify, slow_drafter) == [False, False]
    fair_drafter = DraftCost()
    fair_drafter.observe(1, 4.0)
    fair_drafter.observe(2, 8.0)
    assert choose_drafted([0.9, 0.1], [15, 15], 2, cheap_verify, fair_drafter) == [True, False]
    assert choose_drafted([0.9], [0], 1, cheap_verify, DraftCost()) == [False]  # nothing to draft (block 1)


def test_draft_cost_past_the_largest_bucket_timed_is_optimistic():
    """A lone session's cost extrapolated linearly would forbid ever drafting a batch (a batched drafter
    forward costs far less than one per session): past what was timed, the largest bucket's cost is
    assumed, so one batched call is tried and timed."""
    cost = DraftCost()
    cost.observe(1, 5.0)
    assert cost(8) == 5.0
    cheap_verify = CostCurve((1, 8, 64), (4.0, 5.0, 9.0))
    assert all(choose_drafted([0.8] * 8, [15] * 8, 8, cheap_verify, cost))
    cost.observe(8, 80.0)  # timed: far too slow for these sessions
    assert not any(choose_drafted([0.8] * 8, [15] * 8, 8, cheap_verify, cost))


def test_per_round_overhead_makes_rounds_that_commit_more_worth_more():
    """A step whose rounds cost 10 ms each outside the forward (streaming them, say) gains more from a
    round that commits several tokens than one whose rounds cost nothing."""
    steep = CostCurve((1, 4, 64), (4.0, 6.0, 60.0))
    drafter = DraftCost()
    drafter.observe(4, 8.0)
    assert not any(choose_drafted([0.7] * 4, [15] * 4, 4, steep, drafter))
    assert all(choose_drafted([0.7] * 4, [15] * 4, 4, steep, drafter, fixed_ms=4 * 10.0))


def test_explorations_back_off_while_drafting_does_not_pay():
    """Where speculation does not pay (a steep forward), one session drafts after 8 steps without any,
    then after 16, 32 and 64: the explorations' cost shrinks; once drafting pays it is every 8 again."""
    from dflash.verify_policy import AdaptivePolicy

    policy = AdaptivePolicy(CostCurve((1, 2, 64), (10.0, 20.0, 640.0)))
    explored = [step for step in range(1, 260)
                if any(policy.drafted([0.7, 0.7], [15, 15], [step, 0], 2, 0.0))]
    assert explored == [8, 24, 56, 120, 184, 248]
    policy.cost_curve = CostCurve.flat()  # now every proposal pays
    assert all(policy.drafted([0.7, 0.7], [15, 15], [0, 0], 2, 0.0))
    policy.cost_curve = CostCurve((1, 2, 64), (10.0, 20.0, 640.0))
    assert [s for s in range(1, 30) if any(policy.drafted([0.7, 0.7], [15, 15], [s, 0], 2, 0.0))] == [8, 24]


def test_drafting_must_beat_plain_decoding_by_the_models_own_error():
    """Where drafting is predicted to pay only a little, an error of the step-time model could make it
    lose: the policy drafts only when the predicted gain exceeds the fit's typical error."""
    curve = CostCurve((1, 8, 16, 32, 64), (5.0, 6.0, 7.0, 10.0, 16.0))
    drafter = DraftCost()
    drafter.observe(1, 6.0)
    assert all(choose_drafted([0.6] * 8, [4] * 8, 8, curve, drafter, 4.0))  # a small predicted gain
    assert not any(choose_drafted([0.6] * 8, [4] * 8, 8, curve, drafter, 4.0, margin=0.1))
    assert all(choose_drafted([0.95] * 8, [15] * 8, 8, curve, drafter, 4.0, margin=0.3))  # a large one
    cal = StepCalibration()
    start = 0.0
    for k in range(10):  # step times 10% above or below what the fit can explain, alternately
        cal.step_started(start)
        cal.step_ran(start, draft_ms=0.0, predicted_verify_ms=10.0, sessions=4)
        start += (0.011 if k % 2 else 0.009)
    cal.step_started(start)
    assert cal.relative_error == pytest.approx(0.1, abs=0.02)


def test_step_calibration_learns_the_time_outside_draft_and_forward():
    cal = StepCalibration(window=5)
    assert cal.round_overhead_ms == 0.0
    start = 100.0
    for _ in range(5):  # each step: 2 ms drafting + 6 ms forward predicted, 18 ms from start to start
        cal.step_started(start)
        cal.step_ran(start, draft_ms=2.0, predicted_verify_ms=6.0, sessions=5)
        start += 0.018
    cal.step_started(start)
    assert cal.round_overhead_ms == pytest.approx(2.0)  # (18 - 8) ms over 5 sessions
    cal.idle()  # an idle wait is not a step's period
    cal.step_started(start + 10.0)
    assert cal.round_overhead_ms == pytest.approx(2.0)
    assert cal.forward_scale == 1.0  # every step alike: the excess cannot be told apart, it counts per round


def test_step_time_is_split_between_a_slower_forward_and_a_cost_per_round():
    """A forward running 1.5x slower than its start-up curve (the cores are shared) is charged to the
    forward, in proportion to its size, not to the rounds: else a busy CPU would look like a reason to
    verify more per round."""
    steps = [(f, 1.5 * f + 1.0 * s, s) for f, s in ((6.0, 8), (12.0, 8), (9.0, 4), (20.0, 2), (7.0, 16))]
    scale, per_round = fit_step_time(steps)
    assert scale == pytest.approx(1.5) and per_round == pytest.approx(1.0)
    assert fit_step_time([(f, 2.0 * f, s) for f, _, s in steps]) == pytest.approx((2.0, 0.0))
    assert fit_step_time([(f, 0.1 * f, s) for f, _, s in steps])[0] == 0.5  # kept within [0.5, 4]
    alike = [(10.0, 7.0, 4)] * 6  # every step the same shape, faster than the curve: the forward's scale
    assert fit_step_time(alike) == pytest.approx((0.7, 0.0))
