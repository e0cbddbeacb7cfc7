"""The OpenAI-compatible HTTP API, with the official `openai` client over loopback.

Two tiers. In process: the FastAPI app (openai_api.build_app) served by uvicorn, over the real Ingress
and a real co-located Verifier on tiny models, sessions in a real redis-server: every request shape and
error, and `dflash bench --openai`'s client. On real Ray Serve (slow): `start_local` as `dflash serve`
runs it, the HTTP proxy and the gRPC proxy answering from the same ingress deployment.
"""

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from dflash.bench.load import LoadMethod, SweepSettings, run_sweep
from dflash.loading import build_engine
from dflash.params import SamplingParams
from dflash.service.config import ServiceConfig
from dflash.service.ingress import Ingress
from dflash.service.metrics import ServiceMetrics
from dflash.service.openai_api import OpenAIServer, build_app
from dflash.service.openai_chat import ChatTemplate
from dflash.service.parts import build_verifier_engine
from dflash.service.redis_process import free_port
from dflash.service.session_store import RedisSessionStore
from dflash.service.verifier import Verifier
from service_fixtures import model_dirs, redis_server, wait_until  # noqa: F401
from transformers import PreTrainedTokenizerFast

TOKEN = "openai-s3cret"
MODEL = "tiny"
PROMPT = "def f(x):\n    return"
# Only characters of the tiny char tokenizer (tests/tiny.py).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say (a, b)"}]


@pytest.fixture(scope="module")
def chat_dirs(model_dirs, tmp_path_factory):  # noqa: F811
    """(target dir whose tokenizer has a chat template, drafter dir)."""
    target = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(model_dirs[0], target)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(target)
    return target, model_dirs[1]


@pytest.fixture(scope="module")
def reference(chat_dirs):
    return build_engine(chat_dirs[0], chat_dirs[1], device="cpu", dtype="float32")


def greedy(reference, prompt_ids, n):
    return reference.run(prompt_ids, SamplingParams(max_new_tokens=n, ignore_eos=True))


def config_for(dirs, redis_url, **extra):
    target, drafter = dirs
    return ServiceConfig.from_dict({
        "auth_token": TOKEN, "metrics": "prometheus", "scheduler": {"verify_policy": "full"},
        "model": {"target": str(target), "drafter": str(drafter), "device": "cpu", "dtype": "float32", "name": MODEL},
        "redis": {"url": redis_url}, **extra})


class HttpServer:
    """uvicorn serving `app` on a free loopback port in a thread."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "uvicorn to start")
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def serve_in_process(config, redis_url, chat):
    store = RedisSessionStore(redis_url)
    engine = build_verifier_engine(config, store, None)
    engine.start_loop()  # as VerifierDeployment does: concurrent streams share its steps
    verifier = Verifier(engine, store, MODEL)
    ingress = Ingress(config, ServiceMetrics("prometheus"))

    def open_stream(verify, carrier):  # as VerifierDeployment.stream relays the verifier
        return verifier.stream_async(verify, carrier)

    server = OpenAIServer(ingress, open_stream, chat)
    return HttpServer(build_app(server)), ingress


@pytest.fixture(scope="module")
def http(chat_dirs, redis_server):  # noqa: F811
    config = config_for(chat_dirs, redis_server.url)
    server, ingress = serve_in_process(config, redis_server.url, ChatTemplate.load(str(chat_dirs[0])))
    yield server, ingress
    server.stop()


@pytest.fixture
def client(http):
    return openai.OpenAI(base_url=http[0].url, api_key=TOKEN, max_retries=0, timeout=120)


def stream_text(stream):
    """(text, finish reasons, usage, number of chunks) of an openai stream."""
    text, reasons, usage, n = [], [], None, 0
    for chunk in stream:
        n += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.text if hasattr(choice, "text") else (choice.delta.content or ""))
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return "".join(text), reasons, usage, n


def test_streamed_completion_is_greedy_generation_with_usage(client, reference):
    want = greedy(reference, reference.encode(PROMPT), 24)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, reasons, usage, chunks = stream_text(stream)
    assert text == want.text and reasons == ["length"] and chunks > 2
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(reference.encode(PROMPT)), 24)
    assert usage.total_tokens == usage.prompt_tokens + 24


def test_whole_completion_from_token_ids_with_stop(client, reference):
    ids = reference.encode(PROMPT)
    full = greedy(reference, ids, 24).text
    stop = full[5:7]
    reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, stop=stop,
                                      extra_body={"ignore_eos": True})
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    choice = reply.choices[0]
    assert (choice.text, choice.finish_reason) == (full[: full.index(stop)], "stop")
    assert reply.usage.prompt_tokens == len(ids)


def test_seeded_sampling_repeats_and_top_p(client):
    def once():
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9,
                                         seed=7, extra_body={"ignore_eos": True}).choices[0].text

    assert once() == once()


def test_chat_completion_renders_the_chat_template(client, reference, chat_dirs):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(chat_dirs[0])
    ids = tokenizer(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"]
    want = greedy(reference, ids, 12)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == want.text
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 12)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    text, reasons, usage, _ = stream_text(stream)
    assert (text, reasons, usage) == (want.text, ["length"], None)  # no usage chunk unless asked for


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def error_of(call):
    with pytest.raises(openai.APIStatusError) as err:
        call()
    body = err.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return err.value.status_code, body["error"]


@pytest.mark.parametrize("kwargs, status, param", [
    ({"model": "gpt-4"}, 404, "model"),
    ({"n": 2}, 400, "n"),
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 10**6}, 400, "max_tokens"),
    ({"logprobs": 2}, 400, "logprobs"),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"extra_body": {"guided_json": {}}}, 400, "guided_json"),
    ({"extra_body": {"tools": [{"type": "function"}]}}, 400, "tools"),
])
def test_bad_completion_requests_get_openai_errors_naming_the_field(client, http, kwargs, status, param):
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    errors_before = http[1].metrics.registry.get_sample_value("dflash_errors_total", {"code": "INVALID_ARGUMENT"}) or 0
    code, error = error_of(lambda: client.completions.create(**request))
    assert (code, error["param"]) == (status, param), error
    assert error["message"].startswith(param), error
    if status == 400:  # counted in the same metric as gRPC's errors
        after = http[1].metrics.registry.get_sample_value("dflash_errors_total", {"code": "INVALID_ARGUMENT"})
        assert after == errors_before + 1


def test_chat_refuses_tools_and_unknown_roles(client):
    code, error = error_of(lambda: client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[{"type": "function", "function": {"name": "f"}}]))
    assert (code, error["param"]) == (400, "tools")
    code, error = error_of(lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "tool",
                                                                                         "content": "x"}]))
    assert (code, error["param"]) == (400, "messages[0].role"), error
    assert error["message"].startswith("messages[0].role: "), error


def raw(url, body=None, token=TOKEN):
    """(status, JSON body) of a plain HTTP request: POST `body` (bytes) or GET."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=body, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_malformed_json_wrong_token_and_unknown_path_then_still_serving(http, client):
    url = http[0].url
    status, body = raw(f"{url}/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400 and body["error"]["message"].startswith("request: the body is not valid JSON"), body
    status, body = raw(f"{url}/completions", b"[1, 2]")
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    good = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    for token in ("", "wrong"):
        for status, body in (raw(f"{url}/completions", good, token), raw(f"{url}/models", token=token)):
            assert status == 401 and body["error"]["type"] == "authentication_error", body
    status, body = raw(f"{url}/embeddings")
    assert status == 404 and "error" in body, body
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens <= 3 and reply.choices[0].finish_reason in ("length", "stop")


def test_chat_on_a_target_without_a_chat_template_is_a_clear_400(model_dirs, redis_server):  # noqa: F811
    config = config_for(model_dirs, redis_server.url)
    server, _ = serve_in_process(config, redis_server.url, ChatTemplate.load(str(model_dirs[0])))
    try:
        c = openai.OpenAI(base_url=server.url, api_key=TOKEN, max_retries=0, timeout=120)
        code, error = error_of(lambda: c.chat.completions.create(model=MODEL, messages=MESSAGES))
        assert (code, error["param"]) == (400, "messages")
        assert "no chat template" in error["message"] and "/v1/completions" in error["message"]
        assert c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens <= 2
    finally:
        server.stop()


def test_the_ingress_side_imports_no_torch(chat_dirs):
    """The ingress replica runs on CPU-only proxy nodes: the API and its chat template load without torch."""
    code = ("import sys; from dflash.service import openai_api; from dflash.service.openai_chat import ChatTemplate; "
            f"ids = ChatTemplate.load({str(chat_dirs[0])!r}).prompt_ids({MESSAGES!r}); "
            "assert ids, ids; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_bench_load_sweep_through_the_openai_api(http, tmp_path):
    method = LoadMethod("http", None, openai_url=http[0].url)
    result = run_sweep(SweepSettings("", (1, 2), requests_per_stream=1, max_new_tokens=6, methods=(method,),
                                     token=TOKEN), [PROMPT, "import os\n"])
    cells = result["cells"]
    assert [(c["concurrency"], c["requests"], c["errors"]) for c in cells] == [(1, 1, 0), (2, 2, 0)], cells
    assert all(c["tokens"] == 6 * c["requests"] and c["tokens_per_s"] > 0 for c in cells)
    assert cells[0]["ttft_ms"]["p50"] > 0 and cells[0]["tpot_ms"]["p50"] > 0
    json.dumps(result)


# -- on real Ray Serve -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_service(chat_dirs):
    pytest.importorskip("ray")
    from dflash.service.launcher import start_local

    target, drafter = chat_dirs
    config = ServiceConfig.from_dict({
        "grpc_port": free_port(), "torch_threads": 1, "auth_token": TOKEN,
        "model": {"target": str(target), "drafter": str(drafter), "device": "cpu", "dtype": "float32", "name": MODEL},
        "ingress": {"ray_actor_options": {"num_cpus": 0.1}},
        "verifier": {"ray_actor_options": {"num_cpus": 0.1}, "max_ongoing_requests": 8},
        "scheduler": {"verify_policy": "full"}})
    service = start_local(config, num_cpus=2)  # redis.url "": its own redis-server, as `dflash serve`
    yield service
    service.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_serve_answers_openai_and_grpc_from_one_ingress(ray_service, reference):
    from dflash.service.client import GenerationClient

    assert ray_service.openai_url.startswith("http://127.0.0.1:")
    c = openai.OpenAI(base_url=ray_service.openai_url, api_key=TOKEN, max_retries=0, timeout=300)
    want = greedy(reference, reference.encode(PROMPT), 20)
    stream = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, reasons, usage, _ = stream_text(stream)
    assert (text, reasons) == (want.text, ["length"])
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(reference.encode(PROMPT)), 20)
    reply = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 8 and reply.choices[0].message.content
    for call, status in ((lambda: c.completions.create(model="nope", prompt="x"), 404),
                         (lambda: c.completions.create(model=MODEL, prompt="x", n=2), 400),
                         (lambda: c.completions.create(model=MODEL, prompt="x", max_tokens=-3), 400),
                         (lambda: openai.OpenAI(base_url=ray_service.openai_url, api_key="wrong", max_retries=0)
                          .completions.create(model=MODEL, prompt="x"), 401)):
        assert error_of(call)[0] == status
    status, body = raw(f"{ray_service.openai_url}/completions", b"{not json")
    assert status == 400 and body["error"]["message"].startswith("request:"), body
    again = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert again.choices[0].text == want.text  # still serving, same answer
    with GenerationClient(ray_service.address, token=TOKEN, timeout_s=120) as g:  # gRPC, the same deployment
        started = time.monotonic()
        ids = [t for chunk in g.generate(prompt=PROMPT, max_new_tokens=20, ignore_eos=True) for t in chunk.token_ids]
        assert ids == want.token_ids and time.monotonic() - started < 120


def test_serve_flags_place_the_http_api(monkeypatch):
    from dflash.cli import build_parser
    from dflash.commands.serve import service_config

    monkeypatch.delenv("DFLASH_CONFIG", raising=False)
    config = service_config(build_parser().parse_args(["serve", "--openai-port", "8123", "--host", "0.0.0.0"]))
    assert (config.openai.enabled, config.openai.port, config.openai.host, config.grpc_host) == (True, 8123, "",
                                                                                                "0.0.0.0")
    config = service_config(build_parser().parse_args(["serve", "--no-openai", "--openai-host", "::1"]))
    assert (config.openai.enabled, config.openai.host) == (False, "::1")
