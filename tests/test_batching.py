"""Continuous batching: many sessions per step give each exactly its solo output and solo acceptance.

Tiny real Qwen3 and Llama targets with random DFlash drafters, fp32, and the committed demo pair (a
trained drafter, where a mask or position leaking across sessions would show as lost acceptance).
"""

import contextlib
import threading
import time

import pytest
import torch
from dflash.defaults import demo_pair
from dflash.demo.corpus import heldout_prompts
from dflash.errors import InvalidRequestError
from dflash.loading import build_engine
from dflash.params import SamplingParams
from dflash.scheduler import QueueFullError, SchedulerConfig
from dflash.verify_policy import (
    ARMS,
    BURST,
    FIRST_LOOK,
    PIPED,
    CostCurve,
    Decision,
    MeasuredPolicy,
    choose_verify_lengths,
)
from tiny import FULL, char_tokenizer, engine_for, prompts, tiny_drafter, tiny_target


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

    def on_sessions(self, num_running, num_waiting):
        pass


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
    assert not gen.worth_streaming(10.001, 0.05)  # finished, its last round not yet delivered
    gen.ended = True
    assert gen.worth_streaming(10.001, 0.05)  # its end: at once
    assert [r.token_ids for r in gen.take_ready()] == [[3], [4]] and not gen.outbox


def test_a_request_stream_interval_out_of_range_is_refused_naming_the_field(pair):
    target, drafter = pair
    engine = engine_for(target, drafter, char_tokenizer())
    with pytest.raises(InvalidRequestError, match="stream_interval_ms: must be between 0 and 10000"):
        engine.start(prompts(1)[0], SamplingParams(max_new_tokens=4), stream_interval_ms=20_000)


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


def drive(policy, steps, num_decoding, rate_of, clock, step_s=lambda arm: 0.1, fresh=0):
    """Run `steps` policy steps at a batch of `num_decoding`, each arm committing per session per 100 ms
    what `rate_of(arm)` says, a step taking `step_s(arm)` seconds (100 ms unless told; the first step
    has `fresh` sessions decoding for the first time); -> the arms chosen, in order."""
    arms = []
    for i in range(steps):
        policy.step_started(clock[0])
        decision = policy.decide(num_decoding, fresh if i == 0 else 0)
        arms.append(decision.arm)
        seconds = step_s(decision.arm)
        committed = round(rate_of(decision.arm) * num_decoding * 1000 * seconds)
        policy.step_ran(decision, clock[0], num_decoding, committed, 0)
        clock[0] += seconds
    policy.step_started(clock[0])
    return arms


def _goodput(arms: list[str], rates: dict[str, float]) -> float:
    """What the steps committed per step, on average (every step takes the same time in drive())."""
    return sum(rates[a] for a in arms) / len(arms)


def test_the_measured_policy_goes_with_what_pays_and_switches_both_ways():
    """Every arm is measured soon (plain needs no burst while drafting yields 3x a plain step: the
    yardstick says what it is worth); then the best one runs, the others only in short, rare bursts;
    when the costs change (drafting stops paying, then pays again) the policy follows within a few
    bursts."""
    policy, clock = MeasuredPolicy(CostCurve.flat()), [0.0]
    drafting_pays = {"full": 3.0, "confident": 2.5, "plain": 1.0}
    arms = drive(policy, 200, 1, drafting_pays.__getitem__, clock)
    assert set(arms[: FIRST_LOOK + 2 * BURST]) == {"full", "confident"}  # each measured soon after the start
    assert _goodput(arms[100:], drafting_pays) >= 0.95 * 3.0 and "plain" not in arms
    plain_pays = {"full": 0.6, "confident": 0.8, "plain": 1.0}
    arms = drive(policy, 400, 1, plain_pays.__getitem__, clock)
    assert arms[200:].count("plain") >= 0.85 * 200 and _goodput(arms[200:], plain_pays) >= 0.95
    arms = drive(policy, 400, 1, drafting_pays.__getitem__, clock)
    assert arms[200:].count("full") >= 0.8 * 200 and _goodput(arms[200:], drafting_pays) >= 0.95 * 3.0
    best, ratios = policy.best(1)
    assert best == "full" and ratios["confident"] == pytest.approx(2.5 / 3)


def test_a_drafters_catch_up_does_not_keep_the_policy_on_plain():
    """A drafting step after plain ones also runs the drafter over all the context they made (one slow
    step per switch). Counted in a burst of three it would hide what drafting pays; it is left out, so
    a stream that started on plain (hard text) goes back to drafting once its text turns predictable."""
    policy, clock, last = MeasuredPolicy(CostCurve.flat(), arms=("full", "plain")), [0.0], ["plain"]

    def rate(arm):  # the first drafting step after a plain one commits almost nothing
        catch_up, last[0] = arm == "full" and last[0] == "plain", arm
        return 0.1 if catch_up else {"full": 1.5, "plain": 1.0}[arm]

    drive(policy, 300, 1, {"full": 0.5, "plain": 1.0}.__getitem__, clock)
    assert policy.best(1)[0] == "plain"
    arms = drive(policy, 600, 1, rate, clock)
    assert policy.best(1)[0] == "full" and arms[300:].count("full") >= 0.85 * 300


def _drive_catching_up(policy, steps, catch_up_ms, clock, sessions=16):
    """Like drive() at a batch of 16 where full drafting commits 0.9x of plain per step period, but its
    first step after plain ones also takes `catch_up_ms` per session and plain step since the last draft
    (the drafter taking in their context); -> the arms chosen."""
    arms, since = [], 0
    for _ in range(steps):
        policy.step_started(clock[0])
        decision = policy.decide(sessions, 0)
        arms.append(decision.arm)
        seconds = 0.1 + (since * sessions * catch_up_ms / 1000 if decision.drafts else 0.0)
        since = 0 if decision.drafts else since + 1
        committed = round((0.9 if decision.drafts else 1.0) * sessions * 100)
        policy.step_ran(decision, clock[0], sessions, committed, 0)
        clock[0] += seconds
    policy.step_started(clock[0])
    return arms


@pytest.mark.parametrize("catch_up_ms, looks", [(0.5, "never again"), (0.001, "on a schedule")])
def test_a_big_batch_on_plain_looks_at_drafting_only_where_its_catch_up_leaves_room(catch_up_ms, looks):
    """In a big batch a tie goes to plain, and a look at drafting after plain steps costs a catch-up
    that grows with every plain step before it. Where that cost per plain step alone is more than
    the share of time explorations may take (a CPU: 8 ms per 100 ms step here), drafting is not looked
    at again once measured; where it is small (a GPU) it is looked at on a schedule."""
    policy, clock = MeasuredPolicy(CostCurve.flat(), arms=("full", "plain")), [0.0]
    policy._bucket(16, 16 * 16)  # a 16-session batch the cost model starts on plain (it is predicted to tie)
    policy._buckets[16].best = "plain"
    arms = _drive_catching_up(policy, 2000, catch_up_ms, clock)
    looks_at = [i for i in range(1, len(arms)) if arms[i] == "full" and arms[i - 1] == "plain"]
    assert policy.best(16)[0] == "plain" and looks_at
    if looks == "never again":
        assert looks_at[-1] < 1000 and len(looks_at) <= 2
    else:
        assert len(looks_at) >= 4 and looks_at[-1] > 1000


def test_steps_nobody_could_draft_in_are_not_the_policys():
    """Block-size-1 requests only: the engine does not consult or tell the policy, so a batch size
    first seen there is made later with the cost model's start, not the nearest bucket's arm."""
    model = tiny_target()
    engine = engine_for(model, tiny_drafter(model), config=SchedulerConfig(verify_policy="adaptive"))
    plain = SamplingParams(max_new_tokens=6, block_size=1, ignore_eos=True)
    for gen in [engine.generate([1, 2, 3 + i], plain) for i in range(4)]:
        list(gen)
    assert engine.policy._buckets == {}


@pytest.mark.parametrize("scatter", [(0.4, 1.3, 0.6, 1.1, 0.3, 1.4, 0.9, 0.8), (0.85,) * 8],
                         ids=["scattering", "clear-cut"])
def test_a_lone_streams_hard_start_does_not_keep_it_on_plain(scatter):
    """A lone stream whose first tens of tokens are hard: its drafting steps commit 1 to 3 tokens
    (0.85x plain on average, each step's yield scattering far more, or not at all), then its text turns
    predictable (2.5x). That first loss says how hard a few tokens were; drafting is tried again within
    the stream and wins it back."""
    policy, clock, step = MeasuredPolicy(CostCurve.flat()), [0.0], [0]

    def rate(arm):
        step[0] += 1
        if arm == "plain":
            return 1.0
        base = 0.85 if step[0] <= 40 else 2.5
        return base * scatter[step[0] % len(scatter)] / (sum(scatter) / len(scatter))

    step_s = {"full": 0.27, "confident": 0.27, "plain": 0.1}.__getitem__
    drive(policy, 60, 1, {"full": 0.85, "confident": 0.85, "plain": 1.0}.__getitem__, clock, step_s, fresh=1)
    arms = drive(policy, 128, 1, rate, clock, step_s, fresh=1)
    assert policy.best(1)[0] != "plain" and arms[-30:].count("plain") <= 3, arms


def test_a_new_batch_size_starts_where_the_cost_model_says_then_measurements_decide():
    """A fresh engine's first batch is sixteen sessions, where verifying every block costs 6x a plain
    step (the CPU's curves): it starts on plain and tries drafting only when a burst's predicted loss is
    a few percent of the time since, not eight steps in. Where drafting then pays after all, the
    measurements take it; a lone stream, where verifying a block costs 1.5x a step, starts drafting."""
    cost = CostCurve((1, 16, 256), (6.0, 9.0, 60.0))  # a forward's ms against the tokens it packs
    batch = CostCurve((1, 16), (6.0, 10.0))  # a plain step's ms against its sessions
    policy, clock = MeasuredPolicy(cost, batch), [0.0]
    plain_pays = {"full": 0.5, "confident": 0.5, "plain": 1.0}
    step_s = {"full": 0.06, "confident": 0.06, "plain": 0.01}.__getitem__
    arms = []
    for _ in range(800):  # drive() with the step's full-verify tokens given, as the engine gives them
        policy.step_started(clock[0])
        decision = policy.decide(16, 0, 16 * 16)
        arms.append(decision.arm)
        seconds = step_s(decision.arm)
        policy.step_ran(decision, clock[0], 16, round(plain_pays[decision.arm] * 16 * 1000 * seconds), 0)
        clock[0] += seconds
    # predicted 2 tokens (the prior tau) per 60 ms against one per 10: a burst of 4 drafting steps loses
    # 160 ms, 3% of 5.3 s, 533 plain steps
    assert arms[:500] == ["plain"] * 500 and "full" in arms[500:]
    assert arms[500:].count("plain") >= 0.9 * 300
    drafting_pays = {"full": 4.0, "confident": 3.0, "plain": 1.0}
    drive(policy, 600, 16, drafting_pays.__getitem__, clock, step_s)
    assert policy.best(16)[0] == "full"
    lone = MeasuredPolicy(cost, batch)
    assert lone.decide(1, 1, 16).arm == "full"
    untold = MeasuredPolicy(cost, batch)  # no full_tokens: the nearest bucket's best, full when none
    assert untold.decide(16).arm == "full"


def test_a_drafter_priced_at_start_up_puts_a_big_batchs_first_look_later_or_never():
    """The same curves with the drafter's cost known (measure_drafter_cost): its time per block token
    makes a drafting step dearer than the target's curve alone says, so the first look waits longer;
    a catch-up per plain step above the exploring share means no look at all in that batch."""
    cost = CostCurve((1, 16, 256), (6.0, 9.0, 60.0))
    batch = CostCurve((1, 16), (6.0, 10.0))

    def first_look(policy: MeasuredPolicy) -> int:
        clock = 0.0
        for step in range(3000):  # plain steps of 10 ms, as the engine reports them
            policy.step_started(clock)
            decision = policy.decide(16, 0, 16 * 16)
            if decision.drafts:
                return step
            policy.step_ran(decision, clock, 16, 16, 0)
            clock += 0.01
        return -1

    unpriced = first_look(MeasuredPolicy(cost, batch))
    priced = first_look(MeasuredPolicy(cost, batch, drafter_cost=(0.1, 0.005)))  # 25.6 ms a drafting step
    assert 0 < unpriced < priced
    assert first_look(MeasuredPolicy(cost, batch, drafter_cost=(0.1, 0.05))) == -1  # 0.8 ms a step > 3% of 10
    assert MeasuredPolicy(cost, batch, drafter_cost=(0.1, 0.05)).decide(1, 1, 16).arm == "full"  # lone: unchanged


def test_an_engine_prices_its_local_drafter_at_start_up_and_leaves_no_session_behind():
    target = tiny_target("qwen3")
    engine = engine_for(target, tiny_drafter(target, num_layers=1),
                        config=SchedulerConfig(verify_policy="adaptive", max_running=4))
    assert engine.policy.draft_ms_per_token > 0 and engine.policy.catch_up.ms >= 0
    assert engine.drafter.num_sessions == 0


def test_exploring_a_slow_arm_that_loses_takes_a_small_share_of_the_time():
    """Sixteen streams: a drafting step takes six plain steps' time and commits half what they would.
    Its bursts are spaced by time, not steps, so exploring it costs a few percent of the throughput."""
    policy, clock = MeasuredPolicy(CostCurve.flat()), [0.0]
    rates = {"full": 0.5, "confident": 0.5, "plain": 1.0}
    step_s = {"full": 0.6, "confident": 0.6, "plain": 0.1}.__getitem__
    drive(policy, 400, 16, rates.__getitem__, clock, step_s)
    start = clock[0]
    arms = drive(policy, 4000, 16, rates.__getitem__, clock, step_s)
    seconds = clock[0] - start
    committed = sum(rates[a] * step_s(a) for a in arms)  # per session, in units of 100 ms of plain decoding
    assert policy.best(16)[0] == "plain" and committed / seconds >= 0.95
    assert {"full", "confident"} & set(arms)  # still explored, now and then


def test_a_busy_machines_scatter_does_not_make_a_big_batch_explore_more():
    """Sixteen streams on a machine whose steps scatter (other processes on its cores): a drafting burst
    that loses 0.7x by less than that scatter is still a loss to back off from, as a big batch's sessions
    average the text out and a drafting step costs six plain ones."""
    policy, clock, step = MeasuredPolicy(CostCurve.flat()), [0.0], [0]
    scatter = (0.3, 1.7, 0.5, 1.5, 1.0)

    def rate(arm):
        step[0] += 1
        return scatter[step[0] % len(scatter)] * (1.0 if arm == "plain" else 0.7)

    step_s = {"full": 0.6, "confident": 0.6, "plain": 0.1}.__getitem__
    drive(policy, 400, 16, rate, clock, step_s)
    start = clock[0]
    arms = drive(policy, 4000, 16, rate, clock, step_s)
    drafting_s = sum(step_s(a) for a in arms if a != "plain")
    assert policy.best(16)[0] == "plain" and drafting_s / (clock[0] - start) <= 0.1


def test_a_new_lone_stream_is_looked_at_afresh():
    """A lone stream's yield is its own text's: plain learnt from one hard stream does not hold back the
    next one, whose drafting is tried within FIRST_LOOK steps (a bigger batch keeps its schedule)."""
    policy, clock = MeasuredPolicy(CostCurve.flat()), [0.0]
    hard, easy = {"full": 0.4, "confident": 0.4, "plain": 1.0}, {"full": 3.0, "confident": 2.5, "plain": 1.0}
    arms = drive(policy, 600, 1, hard.__getitem__, clock)
    assert policy.best(1)[0] == "plain"
    # The hard stream explores drafting now and then (its text may change); go on to just after a burst.
    for _ in range(1000):
        if arms[-2] != "plain" and arms[-1] == "plain":
            break
        arms = arms[-1:] + drive(policy, 1, 1, hard.__getitem__, clock)
    else:
        pytest.fail("the hard lone stream never explored drafting again")
    same = drive(policy, FIRST_LOOK + 2, 1, easy.__getitem__, clock)  # the hard stream goes on
    assert set(same) == {"plain"}
    arms = drive(policy, 120, 1, easy.__getitem__, clock, fresh=1)  # another one starts
    assert set(arms[: FIRST_LOOK + 2]) != {"plain"} and policy.best(1)[0] != "plain"
    drive(policy, 600, 8, hard.__getitem__, clock)
    assert set(drive(policy, FIRST_LOOK + 2, 8, easy.__getitem__, clock, fresh=8)) == {"plain"}


def test_the_confident_arm_weighs_proposals_by_what_the_target_accepted():
    """The drafter's probabilities are calibrated by what was accepted: proposals it gives 0.3 that the
    target always accepts are all verified, ones it gives 0.9 that are always rejected are not."""
    policy = MeasuredPolicy(CostCurve((1, 8, 64), (10.0, 11.0, 40.0)))
    shy, sure = torch.full((8,), 0.3), torch.full((8,), 0.9)
    confident = Decision("confident", "best")
    for _ in range(200):
        policy.verified([shy, sure], [8, 8], [8, 0])
    assert policy.verify_lengths(confident, [shy, sure], 2, 0.0) == [8, 0]
    assert policy.verify_lengths(Decision("full", "best"), [shy, sure], 2, 0.0) == [8, 8]


def test_pipelined_drafting_is_an_arm_taken_only_where_it_measures_better():
    """With a drafter that runs apart, drafting beside verification is a fourth arm: chosen when it
    pays, left (and then only explored) when the serial step measures better."""
    policy, clock = MeasuredPolicy(CostCurve.flat(), arms=(*ARMS, PIPED)), [0.0]
    arms = drive(policy, 300, 8, {"full": 2.0, "confident": 1.8, "plain": 1.0, PIPED: 3.0}.__getitem__, clock)
    assert PIPED in arms[: FIRST_LOOK + 3 * BURST] and arms[150:].count(PIPED) >= 0.85 * 150
    arms = drive(policy, 400, 8, {"full": 2.0, "confident": 1.8, "plain": 1.0, PIPED: 1.5}.__getitem__, clock)
    assert arms[200:].count("full") >= 0.85 * 200 and PIPED in arms[200:]
    assert MeasuredPolicy(CostCurve.flat()).decide(8).arm != PIPED  # not an arm of an in-process drafter


def test_the_measured_policy_keeps_each_batch_size_apart_and_skips_what_measures_nothing():
    """Buckets by batch size (1, 2, 4, 8, ...): drafting may pay for one stream and not for eight. Steps
    that prefill, and a period in which the loop waited for work, are not measured."""
    policy, clock = MeasuredPolicy(CostCurve.flat()), [0.0]
    drive(policy, 120, 1, {"full": 3.0, "confident": 2.0, "plain": 1.0}.__getitem__, clock)
    drive(policy, 120, 8, {"full": 0.5, "confident": 0.7, "plain": 1.0}.__getitem__, clock)
    assert policy.best(7)[0] == "plain"  # 7 is in the bucket of 8
    assert policy.best(1)[0] == "full"
    fresh = MeasuredPolicy(CostCurve.flat())
    decision = fresh.decide(1)
    fresh.step_started(0.0)
    fresh.step_ran(decision, 1.0, 1, 50, 64)  # a prefill step: not measured
    fresh.step_started(2.0)
    decision = fresh.decide(1)
    fresh.step_ran(decision, 2.0, 1, 50, 0)
    fresh.idle()  # the loop waited for work: the period measures nothing
    assert fresh.best(1) == ("full", {"confident": None, "plain": None})
    assert not fresh._bucket(1).beside


def test_the_confident_arm_cuts_blocks_where_the_cost_model_says_and_full_verifies_all():
    policy = MeasuredPolicy(CostCurve((1, 2, 64), (10.0, 20.0, 640.0)))  # every token costs a whole step
    probs = [torch.tensor([0.9, 0.9, 0.9]), torch.empty(0)]
    assert policy.verify_lengths(Decision("full", "best"), probs, 2, 0.0) == [3, 0]
    assert policy.verify_lengths(Decision("confident", "best"), probs, 2, 0.0) == [0, 0]
    assert policy.verify_lengths(Decision("plain", "best"), probs, 2, 0.0) == [0, 0]


def test_round_stats_say_how_the_step_was_verified_and_why(pair):
    target, drafter = pair
    engine = engine_for(target, drafter, config=SchedulerConfig(verify_policy="adaptive"))
    rounds = list(engine.generate(prompts(1, seed=4)[0], SamplingParams(max_new_tokens=40, ignore_eos=True)))[1:]
    assert {r.stats.policy_arm for r in rounds} <= set(ARMS)
    assert {r.stats.policy_reason for r in rounds} <= {"best", "exploring", "nothing to draft"}
    assert all(r.stats.draft_tokens == 0 for r in rounds if r.stats.policy_arm == "plain")
    off = engine_for(target, drafter, config=SchedulerConfig(verify_policy="full"))
    rounds = list(off.generate(prompts(1, seed=4)[0], SamplingParams(max_new_tokens=12, ignore_eos=True)))[1:]
    seen = {(r.stats.policy_arm, r.stats.policy_reason) for r in rounds}
    assert ("full", "policy off") in seen and seen <= {("full", "policy off"), ("plain", "nothing to draft")}
    rounds = list(off.generate(prompts(1, seed=4)[0], SamplingParams(max_new_tokens=6, block_size=1)))[1:]
    assert {(r.stats.policy_arm, r.stats.policy_reason) for r in rounds} == {("plain", "block size 1")}


PIPELINED = SchedulerConfig(verify_policy="full", pipeline_drafts="on")


def test_pipelined_drafting_keeps_every_sessions_output_and_acceptance(pair):
    """Drafting beside verification (two cohorts taking turns, draft_pipeline.py; here with the drafter
    in process, in the pipeline's worker thread) changes when a round runs, never what it does: 16
    sessions arriving in waves keep their serial per-round drafts, acceptance and output; 8 mixed
    requests (sampling, stops, block sizes 1 to 16) their solo output; everything is freed at the end."""
    target, drafter = pair
    requests = [(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in prompts(16, seed=3, lo=5, hi=80)]
    starts = [i // 4 for i in range(16)]
    serial = run_together(engine_for(target, drafter), requests, starts)
    engine = engine_for(target, drafter, config=PIPELINED)
    sizes = StepSizes()
    engine.observer = sizes
    piped = run_together(engine, requests, starts)
    for i in range(16):
        assert tokens(piped[i]) == tokens(serial[i]), i
        assert ([(r.stats.draft_tokens, r.stats.accepted_tokens) for r in piped[i]]
                == [(r.stats.draft_tokens, r.stats.accepted_tokens) for r in serial[i]]), i
    assert max(sizes.rounds) <= 10  # cohorts: at most about half of the 16 sessions verify in a step
    mixed = mixed_requests(8)
    solo = [engine_for(target, drafter, char_tokenizer()).run(p, params) for p, params in mixed]
    engine = engine_for(target, drafter, char_tokenizer(), config=PIPELINED)
    together = run_together(engine, mixed, starts=[0, 0, 1, 3, 3, 5, 9, 14])
    assert [tokens(together[i]) for i in range(8)] == [s.token_ids for s in solo]
    assert engine.cache.num_sessions == 0 and engine.drafter.num_sessions == 0
    assert not engine.pipeline.in_flight("r0") and not engine.pipeline._held


def test_a_lone_pipelined_stream_runs_the_serial_round(pair):
    """With nothing to overlap a draft with, the pipeline waits for it at once: one step per round, as
    serial; the cohorts split as evenly as the sessions allow."""
    from dflash.draft_pipeline import cohort_split

    target, drafter = pair
    request = [(prompts(1, seed=5, lo=10, hi=11)[0], SamplingParams(max_new_tokens=30, ignore_eos=True))]
    steps = {}
    for name, config in (("serial", FULL), ("pipelined", PIPELINED)):
        engine = engine_for(target, drafter, config=config)
        observed = StepSizes()
        engine.observer = observed
        rounds = run_together(engine, request, [0])[0]
        steps[name] = (len(observed.rounds), [r.stats.accepted_tokens for r in rounds], tokens(rounds))
    assert steps["pipelined"] == steps["serial"]
    assert [cohort_split(f, r) for f, r in ((1, 0), (8, 0), (4, 4), (3, 1), (1, 3), (2, 1), (0, 5))] == \
        [1, 4, 4, 2, 1, 2, 0]


class SlowJournal:
    """A RoundJournal that records what it stored and takes `delay_s` per write (a Redis script and its
    fsync, slowed down so that the step after it always computes while it is written); its
    `fail_from`-th write and all after raise as an unreachable store does. In memory: the journal's
    contract is what is tested here, RedisSessionStore's own tests run a real redis-server."""

    def __init__(self, delay_s: float = 0.02, fail_from: int | None = None) -> None:
        self.delay_s, self.fail_from = delay_s, fail_from
        self.stored: dict[str, list[int]] = {}
        self.writes = 0
        self.writing = threading.Event()

    def commit_rounds(self, rounds):
        from dflash.errors import DFlashError

        self.writes += 1
        self.writing.set()
        try:
            time.sleep(self.delay_s)
            if self.fail_from is not None and self.writes >= self.fail_from:
                raise DFlashError("session store is unreachable (this test's)")
            for r in rounds:
                self.stored.setdefault(r.session_id, []).extend(r.token_ids)
            return set()
        finally:
            self.writing.clear()


def journaled_engine(pair, journal):
    from dflash.drafter.local import LocalDrafter
    from dflash.engine import SpeculativeEngine
    from dflash.target import TargetModel

    target_model, drafter_model = pair
    target = TargetModel(target_model, drafter_model.config.target_layer_ids)
    drafter = LocalDrafter(drafter_model, target.embed_tokens, target.lm_head)
    return SpeculativeEngine(target, drafter, char_tokenizer(), (), FULL, journal=journal)


def test_with_the_loop_on_a_step_is_stored_beside_the_next_one_and_streamed_only_once_stored(pair):
    journal = SlowJournal()
    engine = journaled_engine(pair, journal)
    forward, overlapped = engine.target.forward, []

    def watched_forward(*args, **kwargs):
        overlapped.append(journal.writing.is_set())
        return forward(*args, **kwargs)

    engine.target.forward = watched_forward
    requests = mixed_requests(4)
    want = [engine_for(*pair, char_tokenizer()).run(*r).token_ids for r in requests]
    engine.start_loop()
    gens = []
    for i, (prompt, params) in enumerate(requests):
        gen = engine.start(prompt, params, seed=params.seed)
        gen.session_id = f"s{i}"
        engine.submit(gen)
        gens.append(gen)
    got = [[] for _ in gens]

    def read(i):
        for round_out in engine.stream(gens[i]):
            got[i].extend(round_out.token_ids)
            # never streamed before it is stored
            assert journal.stored[f"s{i}"][: len(got[i])] == got[i]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(gens))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want and [journal.stored[f"s{i}"] for i in range(len(gens))] == want
    assert any(overlapped), "no forward ran while a step was being stored"


def test_a_store_that_fails_ends_every_stream_after_what_it_stored_and_nothing_after(pair):
    journal = SlowJournal(delay_s=0.005, fail_from=4)
    engine = journaled_engine(pair, journal)
    engine.start_loop()
    params = SamplingParams(max_new_tokens=60, ignore_eos=True, block_size=4)
    gens = []
    for i, prompt in enumerate(prompts(2, seed=5)):
        gen = engine.start(prompt, params)
        gen.session_id = f"s{i}"
        engine.submit(gen)
        gens.append(gen)
    for i, gen in enumerate(gens):
        got = []
        with pytest.raises(Exception, match="unreachable"):
            for round_out in engine.stream(gen):
                got.extend(round_out.token_ids)
        assert got == journal.stored.get(f"s{i}", [])
    # the engine serves on: a request that is not stored
    assert len(engine.run(prompts(1, seed=6)[0], SamplingParams(max_new_tokens=4, ignore_eos=True)).token_ids) == 4
