"""The verifier and drafter replicas in this process, talking real gRPC over loopback, sessions in real Redis.

Checks the disaggregated data path against the in-process engine: identical tokens, drafts identical
to a co-located drafter's (also after a replica dies and another rebuilds the session from the
context log), target-only fallback, resumption, and one trace per request with the drafter inside.
"""

import asyncio
import threading
import time

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dflash.api.v1 import generate_pb2
from dflash.drafter.protocol import DraftSampling
from dflash.loading import build_engine
from dflash.params import SamplingParams
from dflash.service.async_stream import iterate_in_thread
from dflash.service.config import ServiceConfig
from dflash.service.drafter_server import DrafterServer
from dflash.service.ingress import Ingress
from dflash.service.messages import StreamError, VerifyRequest
from dflash.service.parts import build_draft_sessions, build_verifier_engine
from dflash.service.session_store import RedisSessionStore
from dflash.service.verifier import Verifier
from service_fixtures import model_dirs, redis_server, redis_url  # noqa: F401

PROMPTS = ["def f(x):\n    return", "import os\nprint(", "a = [1, 2, 3]\nb ="]
EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def tracer_provider():
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)
    yield provider


def config_for(model_dirs, redis_url, **kw):
    target, drafter = model_dirs
    tree = {"mode": "disaggregated", "model": {"target": str(target), "drafter": str(drafter), "device": "cpu",
            "dtype": "float32"}, "redis": {"url": redis_url, "context_window": 0},
            "drafter_net": {"retry_after_s": 0.2, "timeout_s": 5.0}, "metrics": "prometheus",
            "scheduler": {"verify_policy": "full"}}  # every proposal verified: drafting is observable
    for key, value in kw.items():
        section, _, leaf = key.partition("__")
        (tree.setdefault(section, {}).__setitem__(leaf, value)) if leaf else tree.__setitem__(key, value)
    return ServiceConfig.from_dict(tree)


@pytest.fixture
def service(model_dirs, redis_url):
    """(verifier, [drafter servers], store, reference engine)."""
    config = config_for(model_dirs, redis_url)
    store = RedisSessionStore(redis_url)
    servers = [DrafterServer(build_draft_sessions(config, store), store, advertise_every_s=0.2).start() for _ in range(2)]
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
    return VerifyRequest("s-" + str(abs(hash(prompt))), {"max_new_tokens": max_new_tokens, "ignore_eos": True, **params},
                         prompt_text=prompt)


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
        if i == 2:  # the replica holding the session dies; another one rebuilds from the context log
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
    back = DrafterServer(build_draft_sessions(config, store), store, advertise_every_s=0.2).start()
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


def test_one_trace_per_request_with_rounds_and_drafter_spans(service):
    verifier = service[0]
    ingress = Ingress(config_for(("t", "d"), "redis://unused", model__name="tiny"))

    def open_stream(verify, carrier):
        return iterate_in_thread(lambda cancelled: verifier.stream(verify, carrier, cancelled))

    async def consume():
        request = generate_pb2.GenerateRequest(prompt=PROMPTS[2], max_new_tokens=12, ignore_eos=True)
        return [c async for c in ingress.generate(request, {}, open_stream)]

    EXPORTER.clear()
    chunks = asyncio.run(consume())
    spans = EXPORTER.get_finished_spans()
    [root] = [s for s in spans if s.name == "text_completion tiny"]
    assert root.attributes["gen_ai.request.model"] == "tiny"
    assert root.attributes["gen_ai.usage.output_tokens"] == 12
    assert root.attributes["gen_ai.usage.input_tokens"] == len(PROMPTS[2])
    rounds = [s for s in spans if s.name == "dflash.round"]
    drafts = [s for s in spans if s.name == "dflash.draft"]
    drafted = [s for s in rounds if s.attributes["dflash.round.draft_tokens"] > 0]  # not the prefill, nor a 1-token tail
    steps = {s.context.span_id: s for s in spans if s.name == "dflash.step"}
    assert len(rounds) == len(chunks) and len(drafts) == len(drafted) >= len(chunks) - 2
    # The request's trace: its root and one round span per round. Each batched step is a trace of its
    # own (it serves many requests): the drafter's span is its child, each round links to its step.
    assert {s.context.trace_id for s in rounds} == {root.context.trace_id}
    assert all(s.parent.span_id == root.context.span_id for s in rounds)
    assert all(s.parent.span_id in steps for s in drafts)
    assert all(len(s.links) == 1 and s.links[0].context.span_id in steps for s in rounds)
    assert all(steps[s.links[0].context.span_id].attributes["dflash.step.sessions"] >= 1 for s in rounds)
    assert all(s.attributes["dflash.drafter.replica"] for s in drafted)


def test_cancelled_request_stops_and_frees_caches(service):
    verifier, servers, store, _ = service
    request = new_request(PROMPTS[1], 60)

    async def consume_two():
        got = []
        async for chunk in iterate_in_thread(lambda cancelled: verifier.stream(request, None, cancelled)):
            got.append(chunk)
            if len(got) == 3:
                break  # the client went away
        return got

    assert len(asyncio.run(consume_two())) == 3
    for _ in range(100):  # the engine thread notices between rounds
        if store.get(request.session_id).status == "cancelled":
            break
        time.sleep(0.05)
    assert store.get(request.session_id).status == "cancelled"
    assert all(s.sessions.drafter.num_sessions == 0 for s in servers)
    assert verifier.engine.cache.num_sessions == 0 and verifier.engine.cache.reserved_tokens == 0


def test_windowed_context_log_rebuild_keeps_output_exact(service):
    """With the log bounded to 16 positions, a replica that takes over rebuilds from the window only:
    its drafts may differ, the output may not."""
    from dflash.service import codec

    verifier, servers, store, reference = service
    verifier.engine.drafter.context_window = 16
    request, got, killed = new_request(PROMPTS[0], 40), [], False
    for chunk in verifier.stream(request):
        got += chunk.token_ids
        if chunk.round.index == 20 and not killed:
            [s.stop() for s in servers if s.address == chunk.round.drafter]
            killed = True
            rows = [codec.unpack_log_entry(e)[1].shape[0] for e in store.context_log(request.session_id)]
            assert 16 <= sum(rows) < len(PROMPTS[0])  # the prompt entry is gone
    assert killed and got == expected(reference, PROMPTS[0], 40).token_ids


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
        DrafterServer(build_draft_sessions(config, store), store, advertise_every_s=0.2).start() for _ in range(2)]
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
    assert verifier.engine.cache.num_sessions == 0 and verifier.engine.cache.allocated_bytes == 0
