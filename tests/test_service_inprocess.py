"""The verifier and drafter replicas in this process, talking real gRPC over loopback, sessions in real Redis.

Checks the disaggregated data path against the in-process engine: identical tokens, drafts identical
to a co-located drafter's (also after a replica dies and another rebuilds the session from the
context log), target-only fallback, resumption, and one trace per request with the drafter inside.
"""

import asyncio
import dataclasses
import threading

import pytest
import torch
from dflash.api.v1 import generate_pb2
from dflash.drafter.protocol import DraftSampling
from dflash.loading import build_engine
from dflash.params import SamplingParams
from dflash.service.config import ServiceConfig
from dflash.service.drafter_server import DrafterServer
from dflash.service.ingress import Ingress
from dflash.service.messages import StreamError, VerifyRequest
from dflash.service.parts import build_draft_sessions, build_verifier_engine
from dflash.service.session_store import RedisSessionStore
from dflash.service.verifier import Verifier
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from service_fixtures import install_span_exporter, model_dirs, redis_server, redis_url, wait_until  # noqa: F401

PROMPTS = ["def f(x):\n    return", "import os\nprint(", "a = [1, 2, 3]\nb ="]
EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def tracer_provider():
    install_span_exporter(EXPORTER)


def config_for(model_dirs, redis_url, **kw):
    target, drafter = model_dirs
    tree = {"mode": "disaggregated", "model": {"target": str(target), "drafter": str(drafter), "device": "cpu",
            "dtype": "float32"}, "redis": {"url": redis_url},
            # min_deadline_s = timeout_s: tests that compare round stats must not see a late round on a busy machine
            "drafter_net": {"retry_after_s": 0.2, "timeout_s": 5.0, "min_deadline_s": 5.0, "context_window": 0},
            "metrics": "prometheus",
            # every proposal verified (drafting is observable), drafted beside verification (draft_pipeline.py)
            "scheduler": {"verify_policy": "full", "pipeline_drafts": "on"}}
    for key, value in kw.items():
        section, _, leaf = key.partition("__")
        (tree.setdefault(section, {}).__setitem__(leaf, value)) if leaf else tree.__setitem__(key, value)
    return ServiceConfig.from_dict(tree)


@pytest.fixture
def service(model_dirs, redis_url):
    """(verifier, [drafter servers], store, reference engine)."""
    config = config_for(model_dirs, redis_url)
    store = RedisSessionStore(redis_url)
    servers = [DrafterServer(build_draft_sessions(config), store, advertise_every_s=0.2).start() for _ in range(2)]
    verifier = Verifier(build_verifier_engine(config, store, None), store, "tiny")
    reference = build_engine(model_dirs[0], model_dirs[1], device="cpu", dtype="float32")
    yield verifier, servers, store, reference
    for s in servers:
        s.stop()


def run(verifier, request):
    chunks = list(verifier.stream(request))
    assert not any(isinstance(c, StreamError) for c in chunks), chunks
    return chunks


def tokens_of(chunks):
    return [t for c in chunks for t in c.token_ids]


def expected(reference, prompt, max_new_tokens=24):
    return reference.run(reference.encode(prompt), SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))


def new_request(prompt, max_new_tokens=24, **params):
    return VerifyRequest("s-" + str(abs(hash(prompt))),
                         {"max_new_tokens": max_new_tokens, "ignore_eos": True, **params}, prompt_text=prompt)


def test_remote_drafting_streams_the_engines_tokens(service):
    verifier, servers, _, reference = service
    for prompt in PROMPTS:
        chunks = run(verifier, new_request(prompt))
        want = expected(reference, prompt)
        assert tokens_of(chunks) == want.token_ids and "".join(c.text for c in chunks) == want.text
        assert chunks[-1].final.finish_reason == "length" and chunks[-1].final.usage.completion_tokens == 24
        # a round that drafts nothing (one token left) names no drafter: "" as the proto says
        assert {c.round.drafter for c in chunks[1:] if c.round.draft_tokens} <= {s.address for s in servers}
        assert chunks[1].round.drafter


def test_remote_drafts_equal_local_drafts_across_a_rebuild(service):
    verifier, servers, _, reference = service
    remote, local = verifier.engine.drafter, reference.drafter
    features = torch.randn(30, local.model.fc.in_features)
    pieces = [(0, 12), (12, 15), (15, 22), (22, 30)]
    for i, (a, b) in enumerate(pieces):
        if i == 2:  # the replica holding the session dies; another one restarts it from the verifier's window
            [s for s in servers if s.address == remote.last_replica("x")][0].stop()
        # the cut and the sampling rule travel to the replica and back
        rule = [DraftSampling(min_confidence=0.05), DraftSampling(),
                DraftSampling(temperature=0.8, top_k=40, top_p=0.9, seed=(1 << 63) + 7),
                DraftSampling(temperature=1.0, seed=3, min_confidence=0.05)][i]
        got = remote.draft("x", features[a:b], a, 5, 8, rule)
        assert torch.equal(got, local.draft("x", features[a:b], a, 5, 8, rule))
        assert (len(got) < 7) == (rule.min_confidence > 0)  # an untrained drafter is never that sure
    assert remote.last_replica("x") in {s.address for s in servers}


def test_drafter_killed_mid_stream_gives_identical_output(service):
    verifier, servers, _, reference = service
    prompt, stream, got = PROMPTS[0], None, []
    stream = verifier.stream(new_request(prompt, 40))
    for chunk in stream:
        got += chunk.token_ids
        if chunk.round.index == 5:
            for s in servers:
                if s.address == chunk.round.drafter:
                    s.stop()
    assert got == expected(reference, prompt, 40).token_ids


def test_no_drafter_runs_target_only_and_recovers(service, model_dirs):
    verifier, servers, store, reference = service
    for s in servers:
        s.stop()
    prompt = PROMPTS[1]
    chunks = run(verifier, new_request(prompt))
    assert tokens_of(chunks) == expected(reference, prompt).token_ids
    assert {c.round.drafter for c in chunks[1:]} == {""}  # every round target-only
    config = config_for(model_dirs, store.url)
    back = DrafterServer(build_draft_sessions(config), store, advertise_every_s=0.2).start()
    try:
        chunks = run(verifier, new_request(PROMPTS[2]))
        assert tokens_of(chunks) == expected(reference, PROMPTS[2]).token_ids
        assert {c.round.drafter for c in chunks[1:] if c.round.draft_tokens} == {back.address}
    finally:
        back.stop()


@pytest.mark.parametrize("received", [0, 1, 9, 24])
def test_resume_gives_exactly_the_rest(service, received):
    verifier, _, _, reference = service
    request = new_request(PROMPTS[0], temperature=0.9, top_p=0.9)
    full = tokens_of(run(verifier, request))
    rest = run(verifier, VerifyRequest(request.session_id, tokens_received=received, resume=True))
    assert full[:received] + tokens_of(rest) == full
    assert rest[-1].final.usage.completion_tokens == 24


def test_resume_errors_name_the_field(service):
    verifier = service[0]
    [err] = list(verifier.stream(VerifyRequest("unknown", resume=True)))
    assert err.code == "NOT_FOUND" and err.message.startswith("session_id")
    request = new_request(PROMPTS[0], 5)
    run(verifier, request)
    [err] = list(verifier.stream(VerifyRequest(request.session_id, tokens_received=6, resume=True)))
    assert err.code == "INVALID_ARGUMENT" and err.message.startswith("tokens_received")


def test_prompt_over_the_context_is_invalid(service):
    [err] = list(service[0].stream(new_request("x" * 300)))
    assert err.code == "INVALID_ARGUMENT" and err.message.startswith("prompt")


def test_async_streams_of_8_mixed_requests_get_their_solo_output_and_round_stats(service):
    """The server's path (Verifier.stream_async: coroutines on one event loop, woken once per step): 8
    requests at once (lengths, temperatures, stops; one with its own stream interval 0) each get the
    tokens and the per-round stats (draft, accepted, committed) of their solo run, every round once."""
    verifier = service[0]
    mixed = [dict(max_new_tokens=10 + 6 * i, ignore_eos=i % 3 != 0, temperature=(0.0, 0.9)[i % 2], seed=40 + i,
                  stop=("\n\n",) if i % 4 == 1 else ()) for i in range(8)]

    def request(i, tag, **kw):
        return dataclasses.replace(VerifyRequest(f"{tag}-{i}", mixed[i], prompt_text=PROMPTS[i % 3] + " " * i), **kw)

    def stats(chunks):
        return [(r.index, r.draft_tokens, r.accepted_tokens, r.committed) for c in chunks for r in c.rounds]

    solo = [run(verifier, request(i, "solo")) for i in range(8)]

    async def together():
        async def one(i):
            return [c async for c in verifier.stream_async(request(i, "together", stream_interval_ms=0 if i == 5
                                                                             else None))]
        return await asyncio.gather(*(one(i) for i in range(8)))

    for want, got in zip(solo, asyncio.run(together())):
        assert not any(isinstance(c, StreamError) for c in got), got
        assert tokens_of(got) == tokens_of(want) and stats(got) == stats(want)
        assert [i for i, *_ in stats(got)] == list(range(len(stats(got))))  # every round once, in order
        assert got[-1].final.finish_reason == want[-1].final.finish_reason
        assert "".join(c.text for c in got) == "".join(c.text for c in want)


def test_one_trace_per_request_with_rounds_and_drafter_spans(service):
    verifier = service[0]
    ingress = Ingress(config_for(("t", "d"), "redis://unused", model__name="tiny"))

    async def consume():
        request = generate_pb2.GenerateRequest(prompt=PROMPTS[2], max_new_tokens=12, ignore_eos=True)
        return [c async for c in ingress.generate(request, {}, verifier.stream_async)]

    EXPORTER.clear()
    chunks = asyncio.run(consume())
    spans = EXPORTER.get_finished_spans()
    [root] = [s for s in spans if s.name == "text_completion tiny"]
    assert root.attributes["gen_ai.request.model"] == "tiny"
    assert root.attributes["gen_ai.usage.output_tokens"] == 12
    assert root.attributes["gen_ai.usage.input_tokens"] == len(PROMPTS[2])
    rounds = [s for s in spans if s.name == "dflash.round"]
    drafts = [s for s in spans if s.name == "dflash.draft"]
    # not the prefill, nor a 1-token tail
    drafted = [s for s in rounds if s.attributes["dflash.round.draft_tokens"] > 0]
    steps = {s.context.span_id: s for s in spans if s.name == "dflash.step"}
    num_rounds = sum(len(c.rounds) for c in chunks)
    assert len(rounds) == num_rounds and len(drafts) == len(drafted) >= num_rounds - 2
    # The request's trace: its root and one round span per round. Each batched step is a trace of its
    # own (it serves many requests): the drafter's span is its child, each round links to its step.
    assert {s.context.trace_id for s in rounds} == {root.context.trace_id}
    assert all(s.parent.span_id == root.context.span_id for s in rounds)
    calls = {s.context.span_id: s for s in spans if s.name == "dflash.drafts"}
    assert all(s.parent.span_id in calls for s in drafts) and all(c.parent.span_id in steps for c in calls.values())
    assert all(len(s.links) == 1 and s.links[0].context.span_id in steps for s in rounds)
    assert all(steps[s.links[0].context.span_id].attributes["dflash.step.sessions"] >= 1 for s in rounds)
    assert all(s.attributes["dflash.drafter.replica"] for s in drafted)


def test_cancelled_request_stops_and_frees_caches(service):
    verifier, servers, store, _ = service
    request = new_request(PROMPTS[1], 60)

    async def consume_two():
        got = []
        async for chunk in verifier.stream_async(request):
            got.append(chunk)
            if len(got) == 3:
                break  # the client went away
        return got

    assert len(asyncio.run(consume_two())) == 3
    wait_until(lambda: store.get(request.session_id).status == "cancelled", 10, "the session to be cancelled")
    # the step loop frees them after the step in progress
    wait_until(lambda: all(s.sessions.drafter.num_sessions == 0 for s in servers), 10, "drafter sessions freed")
    wait_until(lambda: verifier.engine.cache.num_sessions == 0 == verifier.engine.cache.reserved_tokens, 10,
               "the verifier's cache freed")


def test_windowed_context_restart_keeps_output_exact(service):
    """With the verifier keeping 16 positions of context per session, a replica that takes over
    restarts the session from that window only: its drafts may differ, the output may not. Redis
    holds no tensors at any point."""
    verifier, servers, store, reference = service
    drafter = verifier.engine.drafter
    drafter.net = dataclasses.replace(drafter.net, context_window=16)
    request, got, killed = new_request(PROMPTS[0], 40), [], False
    for chunk in verifier.stream(request):
        got += chunk.token_ids
        if chunk.round.index == 20 and not killed:
            [s.stop() for s in servers if s.address == chunk.round.drafter]
            killed = True
            window = drafter.window(f"{request.session_id}.1")  # the engine keys caches by session and owner
            assert 16 <= window.tensor().shape[0] < len(PROMPTS[0]) and window.start > 0  # the prompt is gone
            assert {k.decode() for k in store.redis.keys(f"{store.prefix}:s:{request.session_id}*")} == {
                f"{store.prefix}:s:{request.session_id}", f"{store.prefix}:s:{request.session_id}:out"}
    assert killed and got == expected(reference, PROMPTS[0], 40).token_ids


def test_replica_that_lost_a_session_gets_it_back_from_the_verifier(service):
    """A replica that drops a session's cache (evicted, or restarted at the same address) answers
    missing_context; the verifier restarts the session there with its window, in the same step."""
    verifier, servers, _, reference = service
    request, got, dropped = new_request(PROMPTS[1], 40), [], None
    for chunk in verifier.stream(request):
        got += chunk.token_ids
        if chunk.round.index == 4 and dropped is None:
            dropped = [s for s in servers if s.address == chunk.round.drafter][0]
            dropped.sessions.release(request.session_id)
        elif dropped is not None and chunk.round.index == 5:
            assert chunk.round.drafter == dropped.address  # the same replica drafted the very next round
    assert dropped is not None and got == expected(reference, PROMPTS[1], 40).token_ids


def test_resume_while_the_old_stream_runs_takes_the_session_over(service):
    """A client reconnects (resume) while the verifier still streams to the connection it lost: the
    resume owns the session from then on, the old stream ends with ABORTED at its next step without
    writing anything, and the stored output is exactly the solo output."""
    verifier, _, store, reference = service
    request = new_request(PROMPTS[0], 40)
    want = expected(reference, PROMPTS[0], 40).token_ids
    old, received = verifier.stream(request), []
    for chunk in old:
        received += chunk.token_ids
        if len(received) >= 10:
            break  # the connection is gone; the old stream is still alive in the verifier
    rest = run(verifier, VerifyRequest(request.session_id, tokens_received=len(received), resume=True))
    [ended] = list(old)
    assert isinstance(ended, StreamError) and ended.code == "ABORTED" and "taken over" in ended.message
    assert received + tokens_of(rest) == want
    record = store.get(request.session_id)
    assert record.output_ids == want and record.status == "finished" and record.owner == 2
    assert verifier.engine.cache.num_sessions == 0


def test_racing_resumes_end_with_one_consistent_output(service):
    verifier, _, store, reference = service
    request = new_request(PROMPTS[2], 40, temperature=0.9, seed=5)
    full = tokens_of(run(verifier, request))
    results, barrier = [], threading.Barrier(2)

    def resume():  # two clients that both received 12 tokens reconnect at the same moment
        barrier.wait()
        results.append(list(verifier.stream(VerifyRequest(request.session_id, tokens_received=12, resume=True))))

    threads = [threading.Thread(target=resume) for _ in range(2)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    ended = [chunks[-1] for chunks in results]
    assert len(results) == 2 and any(not isinstance(e, StreamError) and e.HasField("final") for e in ended)
    for chunks in results:
        if isinstance(chunks[-1], StreamError):  # the one that lost the session, at its first step
            assert chunks[-1].code == "ABORTED"
        else:
            assert full[:12] + tokens_of(chunks) == full
    record = store.get(request.session_id)
    assert record.output_ids == full and record.status == "finished" and record.owner == 3


def test_redis_holds_no_tensors_and_a_few_bytes_per_token(redis_url):
    """One 256-token greedy generation of the demo pair in disaggregated mode: the session's keys hold
    its request and token ids only, within 8 KiB + 64 bytes per committed token."""
    config = ServiceConfig.from_dict({"mode": "disaggregated", "model": {"device": "cpu", "dtype": "float32"},
                                      "redis": {"url": redis_url, "key_prefix": "mem"},
                                      "scheduler": {"verify_policy": "full"}})
    store = RedisSessionStore(redis_url, prefix="mem")
    server = DrafterServer(build_draft_sessions(config), store, advertise_every_s=0.2).start()
    try:
        verifier = Verifier(build_verifier_engine(config, store, None), store, "demo")
        request = VerifyRequest("memory-test", {"max_new_tokens": 256, "ignore_eos": True},
                                prompt_text="import os\n\ndef walk(path):\n")
        chunks = run(verifier, request)
        assert len(tokens_of(chunks)) == 256 and {c.round.drafter for c in chunks[1:3]} == {server.address}
    finally:
        server.stop()
    keys = sorted(k.decode() for k in store.redis.keys("mem:s:*"))
    assert keys == ["mem:s:memory-test", "mem:s:memory-test:out"]
    used = store.session_bytes("memory-test")
    assert used <= 8192 + 64 * 256, used  # 3.4 KB measured; the context log it replaced took ~5 MB


CONCURRENT = [
    (PROMPTS[i % 3] + " " * (i // 3), {"max_new_tokens": 10 + 3 * i, "ignore_eos": True,
                                        "temperature": (0.0, 0.9)[i % 2], "seed": i,
                                        **({"stop": ["\n"]} if i == 5 else {})})
    for i in range(8)
]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_concurrent_streams_share_steps_and_get_their_solo_output(model_dirs, redis_url, mode):
    """Eight Generate streams at once through the verifier (each in its own thread, as Serve runs them):
    each gets exactly its solo output, their rounds share batched steps, and in disaggregated mode the
    drafter replicas draft many sessions per DraftBatch call."""
    config = config_for(model_dirs, redis_url, mode=mode)
    store = RedisSessionStore(redis_url)
    servers = [] if mode == "colocated" else [
        DrafterServer(build_draft_sessions(config), store, advertise_every_s=0.2).start() for _ in range(2)]
    verifier = Verifier(build_verifier_engine(config, store, None), store, "tiny")
    reference = build_engine(model_dirs[0], model_dirs[1], device="cpu", dtype="float32")
    EXPORTER.clear()
    got = {}

    def client(i):
        prompt, params = CONCURRENT[i]
        got[i] = run(verifier, VerifyRequest(f"c-{mode}-{i}", params, prompt_text=prompt))

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    finally:
        for s in servers:
            s.stop()
    for i, (prompt, params) in enumerate(CONCURRENT):
        want = reference.run(reference.encode(prompt), SamplingParams(**params))
        assert tokens_of(got[i]) == want.token_ids, i
        assert "".join(c.text for c in got[i]) == want.text
    spans = EXPORTER.get_finished_spans()
    assert max(s.attributes["dflash.step.sessions"] for s in spans if s.name == "dflash.step") > 1
    if servers:
        assert max(s.attributes["dflash.sessions"] for s in spans if s.name == "dflash.draft") > 1
        # Drafting beside verification (draft_pipeline.py): some sessions' draft call ran inside a step
        # that verified other sessions.
        steps = [s for s in spans if s.name == "dflash.step"]
        calls = [s for s in spans if s.name == "dflash.drafts"]
        verified = [(step, set(step.attributes["dflash.step.request_ids"])) for step in steps]
        assert any(step.start_time <= call.start_time and call.end_time <= step.end_time and ids
                   and not set(call.attributes["dflash.drafts.session_ids"]) & ids
                   for call in calls for step, ids in verified)
    assert verifier.engine.cache.num_sessions == 0 and verifier.engine.cache.allocated_bytes == 0
