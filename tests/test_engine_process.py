"""The verifier's engine in a process of its own (engine_process.py): a real child process running the
engine on tiny models, its rounds journaled to a real redis-server, streamed through the Verifier.

Checks what moving the engine out must not change: every stream equals its solo output (greedy and
sampled requests at once, on the server's asyncio path, coalesced chunks with every round's stats),
per-round spans and step metrics made in the replica, cancels that free the child's sessions, fencing
by a resume, and what a dead child does to its streams and to the replica's health (and that the
child dies with its replica).
"""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from dflash.errors import InvalidRequestError
from dflash.loading import build_engine
from dflash.params import SamplingParams
from dflash.scheduler import SchedulerConfig
from dflash.service.engine_process import EngineProcess, EngineProcessError
from dflash.service.messages import StreamError, VerifyRequest
from dflash.service.metrics import ServiceMetrics
from dflash.service.session_store import RedisSessionStore
from dflash.service.step_telemetry import StepTelemetry
from dflash.service.verifier import Verifier
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from service_fixtures import install_span_exporter, model_dirs, redis_server, redis_url, wait_until  # noqa: F401

EXPORTER = InMemorySpanExporter()
# Greedy and sampled, several block sizes and a stop string: each must come out as it does alone.
REQUESTS = [
    ("def f(x):\n    return", {}),
    ("import os\nprint(", {"temperature": 0.8, "seed": 7}),
    ("a = [1, 2, 3]\nb =", {"block_size": 4}),
    ("class A:\n", {"temperature": 1.0, "top_p": 0.9, "seed": 11}),
    ("x = 1\n", {"block_size": 1}),
    ("for i in range(", {"temperature": 0.6, "top_k": 20, "seed": 3, "block_size": 2}),
    ("def g():\n", {"stop": ["e"]}),
    ("while True:\n", {}),
]


@pytest.fixture(scope="module", autouse=True)
def tracer_provider():
    install_span_exporter(EXPORTER)


def config_for(model_dirs, redis_url, **scheduler):
    target, drafter = model_dirs
    return {"model": {"target": str(target), "drafter": str(drafter), "device": "cpu", "dtype": "float32"},
            "redis": {"url": redis_url}, "metrics": "prometheus", "torch_threads": 1,
            # every proposal verified: the rounds are the same whatever else runs
            "scheduler": {"verify_policy": "full", **scheduler}}


@pytest.fixture
def engine_process(model_dirs, redis_url):
    metrics = ServiceMetrics("prometheus")
    process = EngineProcess(config_for(model_dirs, redis_url), StepTelemetry(metrics))
    yield process, RedisSessionStore(redis_url), metrics
    process.close()


@pytest.fixture(scope="module")
def reference(model_dirs):
    return build_engine(*model_dirs, device="cpu", dtype="float32", scheduler=SchedulerConfig(verify_policy="full"))


def request(i, prompt, params, max_new_tokens=40, **kw):
    return VerifyRequest(f"ep-{i}-{time.monotonic_ns()}", {"max_new_tokens": max_new_tokens, "ignore_eos": True,
                                                          **params}, prompt_text=prompt, **kw)


def solo(reference, prompt, params, max_new_tokens=40):
    ids = reference.encode(prompt)
    return list(reference.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **params)))


async def read_all(verifier, requests):
    async def one(r):
        return [c async for c in verifier.stream_async(r)]
    return await asyncio.gather(*(one(r) for r in requests))


def test_every_stream_equals_its_solo_output_with_every_rounds_stats(engine_process, reference):
    process, store, metrics = engine_process
    verifier = Verifier(process, store, "tiny", metrics)
    requests = [request(i, p, params) for i, (p, params) in enumerate(REQUESTS)]
    # a stream interval long enough that most chunks carry several rounds
    requests = [VerifyRequest(r.session_id, r.params, prompt_text=r.prompt_text, stream_interval_ms=30)
                for r in requests]
    EXPORTER.clear()
    streams = asyncio.run(read_all(verifier, requests))
    coalesced = 0
    for (prompt, params), chunks in zip(REQUESTS, streams):
        assert not any(isinstance(c, StreamError) for c in chunks), chunks
        want = solo(reference, prompt, params)
        assert [t for c in chunks for t in c.token_ids] == [t for r in want for t in r.token_ids], (prompt, params)
        assert "".join(c.text for c in chunks) == "".join(r.text for r in want)
        got_rounds = [(s.index, s.draft_tokens, s.accepted_tokens, s.committed) for c in chunks for s in c.rounds]
        assert got_rounds == [(r.stats.index, r.stats.draft_tokens, r.stats.accepted_tokens, r.stats.committed)
                              for r in want if r.token_ids or r.finish_reason or r.stats.index == 0]
        assert chunks[-1].final.finish_reason == want[-1].finish_reason
        assert chunks[-1].final.rounds == want[-1].totals.rounds
        coalesced += sum(len(c.rounds) > 1 for c in chunks)
        assert store.get(chunks[0].session_id).output_ids == [t for r in want for t in r.token_ids]
    assert coalesced > 0
    # the per-round spans are made in the replica from the child's step reports, one per round
    rounds = [s for s in EXPORTER.get_finished_spans() if s.name == "dflash.round"]
    assert len(rounds) == sum(len(solo(reference, p, params)) for p, params in REQUESTS)
    steps = [s for s in EXPORTER.get_finished_spans() if s.name == "dflash.step"]
    assert steps and all(s.end_time >= s.start_time for s in steps)
    assert all(s.links and s.start_time >= min(x.start_time for x in steps) for s in rounds)


def test_a_bad_request_is_refused_in_the_replica_naming_its_field(engine_process):
    process, store, metrics = engine_process
    verifier = Verifier(process, store, "tiny", metrics)
    (chunks,) = asyncio.run(read_all(verifier, [request(0, "x", {"block_size": 99})]))
    assert isinstance(chunks[0], StreamError) and chunks[0].code == "INVALID_ARGUMENT"
    assert "block_size" in chunks[0].message
    error = InvalidRequestError("prompt", "is empty")
    import pickle

    copy = pickle.loads(pickle.dumps(error))  # what the child sends back when its own check refuses one
    assert type(copy) is InvalidRequestError and copy.field == "prompt" and str(copy) == str(error)


def test_a_cancelled_stream_frees_its_session_in_the_child(engine_process):
    process, store, metrics = engine_process
    verifier = Verifier(process, store, "tiny", metrics)
    stream = verifier.stream(request(0, "def f(x):", {}, max_new_tokens=200, stream_interval_ms=0))
    first = next(stream)
    assert first.token_ids
    wait_until(lambda: process.num_running == 1, what="the child running the request")
    stream.close()
    wait_until(lambda: process.num_running == 0 and process.num_waiting == 0, what="the child freeing it")
    assert store.get(first.session_id).status == "cancelled"
    # and the engine serves on
    chunks = list(verifier.stream(request(1, "x = 1\n", {})))
    assert sum(len(c.token_ids) for c in chunks) == 40


def test_a_resume_fences_the_stream_it_took_over(engine_process, reference):
    process, store, metrics = engine_process
    verifier = Verifier(process, store, "tiny", metrics)
    first = request(0, "def f(x):\n    return", {}, max_new_tokens=200, stream_interval_ms=0)
    old = verifier.stream(first)
    received = list(next(old).token_ids)
    resumed = list(verifier.stream(VerifyRequest(first.session_id, tokens_received=len(received), resume=True)))
    rest = list(old)
    assert isinstance(rest[-1], StreamError) and rest[-1].code == "ABORTED", rest[-1:]
    got = received + [t for c in resumed for t in c.token_ids]
    assert got == [t for r in solo(reference, first.prompt_text, {}, 200) for t in r.token_ids]


def test_a_killed_engine_process_fails_its_streams_and_the_replica(engine_process):
    process, store, metrics = engine_process
    verifier = Verifier(process, store, "tiny", metrics)
    stream = verifier.stream(request(0, "def f(x):", {}, max_new_tokens=200, stream_interval_ms=0))
    assert next(stream).token_ids
    os.kill(process.pid, signal.SIGKILL)
    rest = list(stream)
    assert isinstance(rest[-1], StreamError) and rest[-1].code == "UNAVAILABLE", rest[-1:]
    assert "engine process exited" in rest[-1].message and "tokens_received" in rest[-1].message
    assert not process.alive
    (chunks,) = asyncio.run(read_all(verifier, [request(1, "x", {})]))  # a new request: refused at once
    assert len(chunks) == 1 and chunks[0].code == "UNAVAILABLE"
    with pytest.raises(EngineProcessError):
        process.submit(process.start([3, 4], SamplingParams(max_new_tokens=2)))


def test_the_engine_process_exits_with_its_replica(model_dirs, redis_url, tmp_path):
    script = tmp_path / "replica.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from dflash.service.engine_process import EngineProcess
        process = EngineProcess({config_for(model_dirs, redis_url)!r})
        print(process.pid, flush=True)
        time.sleep(600)
    """))
    replica = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(replica.stdout.readline())
        os.kill(replica.pid, signal.SIGKILL)  # no close, no atexit: only the kernel closing its socket

        def gone():
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return True
            return open(f"/proc/{child}/stat").read().split()[2] == "Z"  # exited, not yet reaped
        wait_until(gone, what="the engine process exiting")
    finally:
        replica.kill()
        replica.wait()
