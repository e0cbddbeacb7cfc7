"""`dflash bench` on tiny models: the table, JSON, plots, greedy check, the round profile, the service
client against a loopback gRPC server, the load sweep against the real service (Ingress + Verifier on
the tiny models, minus Ray), and the GPU-scale script in --tiny mode."""

import asyncio
import json
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from dflash.api.v1 import generate_pb2 as pb
from dflash.api.v1 import generate_pb2_grpc
from dflash.bench.load import Record, SweepSettings, add_speedups, method_ratios, percentile, run_sweep, summarize_cell
from dflash.bench.load_report import format_sweep
from dflash.bench.methods import EngineMethod, Sample, ServiceMethod
from dflash.bench.profile_round import PARTS, format_profile, profile_round
from dflash.bench.report import markdown_table, summarize
from dflash.bench.runner import BenchSettings, run_bench
from dflash.cli import main
from dflash.drafter.checkpoint import save_drafter
from dflash.params import SamplingParams
from dflash.service.config import ServiceConfig
from dflash.service.ingress import Ingress
from dflash.service.parts import build_verifier_engine
from dflash.service.session_store import MemorySessionStore
from dflash.service.verifier import Verifier
from service_fixtures import IngressServicer, model_dirs  # noqa: F401
from tiny import EOS_ID, char_tokenizer, engine_for, tiny_drafter, tiny_target

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["def f(x):\n    return x", "class a(b):\n    pass"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    target = tiny_target("qwen3")
    target.save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    save_drafter(tiny_drafter(target, block_size=16), root / "drafter")
    ar = tiny_target("qwen3", seed=3, layers=1)
    ar.save_pretrained(root / "ar")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


@pytest.fixture(scope="module")
def engines():
    target = tiny_target("qwen3")
    tok = char_tokenizer()
    return engine_for(target, tiny_drafter(target), tok, (EOS_ID,)), engine_for(target, None, tok, (EOS_ID,))


def test_bench_quick_writes_table_json_plots(dirs, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["bench", "--target", dirs / "target", "--drafter", dirs / "drafter", "--ar-draft", dirs / "ar",
            "--prompts", dirs / "prompts.jsonl", "--quick", "--max-new-tokens", 12, "--out", out, "--device", "cpu"]
    assert main([str(a) for a in args]) == 0
    printed = capsys.readouterr().out
    for name in ("target only (engine, block 1)", "transformers generate", "transformers assisted (AR draft)",
                 "transformers prompt lookup", "DFlash block 16", "DFlash block 16, draft confidence 0.05",
                 "DFlash block 8", "transformers DFlash (same drafter)", "DFlash via service (gRPC)"):
        assert name in printed
    assert "| method | T | decode tok/s | speedup |" in printed and "draft forward (drafter layers)" in printed
    data = json.loads((out / "bench.json").read_text())
    rows = data["rows"]
    greedy = [r for r in rows if r.get("temperature") == 0.0 and "unavailable" not in r]
    assert len(greedy) == 8 and {r["temperature"] for r in rows if "unavailable" not in r} == {0.0, 1.0}
    for r in greedy:
        assert r["greedy_equal"] == "reference" or r["greedy_equal"] == {"equal": 2, "prompts": 2}, r
        assert r["decode_tokens_per_s"] > 0 and r["tau"] >= 1.0
    ref = next(r for r in greedy if r["greedy_equal"] == "reference")
    assert ref["speedup"] == 1.0 and ref["tau"] == 1.0
    service = next(r for r in rows if r["method"] == "DFlash via service (gRPC)")
    assert "--service" in service["unavailable"]
    for png in ("speedup.png", "tau_histogram.png", "round_time.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    md = (out / "results.md").read_text()
    assert "![speedup](speedup.png)" in md and "dflash bench" in md and data["machine"]["cpu_count"]
    assert "--quick" in data["command"] and "--max-new-tokens 12" in data["command"]
    assert main([str(a) for a in args[:-4]] + ["--profile", "--device", "cpu"]) == 0  # the profile alone
    assert "verify forward (target, block)" in capsys.readouterr().out


def test_summarize_speedup_mismatch_and_broken_method():
    class Fixed:
        def __init__(self, name, tokens, decode_s, fail=False):
            self.name, self.tokens, self.decode_s, self.fail = name, tokens, decode_s, fail

        def run(self, prompt_ids, max_new_tokens, temperature, seed):
            if self.fail:
                raise RuntimeError("boom")
            return Sample(self.tokens, 0.01, self.decode_s, 1, [1] * (len(self.tokens) - 1), None, self.decode_s)

    methods = [Fixed("ref", [1, 2, 3, 4, 5], 1.0), Fixed("fast", [1, 2, 3, 4, 5], 0.25),
               Fixed("wrong", [1, 2, 9, 9, 9], 0.5), Fixed("broken", [], 1.0, fail=True)]
    run = run_bench(methods, [[1, 2], [3]], BenchSettings(5, (0.0,)), progress=False)
    rows = {r["method"]: r for r in summarize(run, "ref", {"absent": "not built"})}
    assert rows["fast"]["speedup"] == 4.0 and rows["fast"]["greedy_equal"] == {"equal": 2, "prompts": 2}
    assert rows["wrong"]["greedy_equal"] == {"equal": 0, "prompts": 2}
    assert "RuntimeError: boom" in rows["broken"]["unavailable"] and rows["absent"]["unavailable"] == "not built"
    table = markdown_table(list(rows.values()))
    assert "NO (0/2)" in table and "4.00x" in table and "unavailable: not built" in table


def test_profile_parts_add_up_and_engine_left_clean(engines):
    engine, baseline = engines
    prompt = engine.encode(PROMPTS[0])
    p = profile_round(engine, prompt, 16, rounds=4, warmup=1, baseline=baseline)
    assert set(p.parts_ms) == {k for k, _ in PARTS} and p.rounds == 3
    assert sum(p.parts_ms.values()) == pytest.approx(p.round_ms, rel=1e-6)
    assert p.parts_ms["verify_forward"] > 0 and p.parts_ms["draft_forward"] > 0 and p.target_step_ms > 0
    text = format_profile(p, tau=1.0)
    assert all(label in text for _, label in PARTS) and "speedup = tau" in text
    assert 1.0 <= p.committed_per_round <= 16 and 1.0 <= p.verified_per_round <= 16
    # engine left clean: no session in the target cache or the drafter, no timer left behind
    assert engine.cache.num_sessions == 0 and engine.cache.reserved_tokens == 0 and engine.drafter.num_sessions == 0
    assert baseline.cache.num_sessions == 0 and baseline.cache.reserved_tokens == 0
    assert engine.num_running == engine.num_waiting == 0
    assert "forward" not in vars(engine.target) and "crop" not in vars(engine.cache)
    assert "draft_batch" not in vars(engine.drafter) and "_queue_features" not in vars(engine)
    assert "forward_packed" not in vars(engine.drafter.model)
    assert not engine.target.model._forward_hooks and not engine.drafter.model._forward_pre_hooks
    params = SamplingParams(max_new_tokens=20)
    assert engine.run(prompt, params).token_ids == baseline.run(prompt, params).token_ids


# -- the service client, against a loopback server that streams our engine ------------------------


class EngineServicer(generate_pb2_grpc.GenerationServicer):
    """A stand-in for `dflash serve`: the public API over one in-process engine (rounds serialized)."""

    def __init__(self, engine, abort: bool = False):
        self.engine, self.abort, self.lock = engine, abort, threading.Lock()

    def Generate(self, request, context):
        if self.abort:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded")
        ids = list(request.prompt_token_ids) or self.engine.encode(request.prompt)

        def opt(f):
            return getattr(request, f) if request.HasField(f) else None

        params = SamplingParams(max_new_tokens=opt("max_new_tokens") or 128, temperature=request.temperature,
                                seed=opt("seed"), block_size=opt("block_size"))
        stream = self.engine.generate(ids, params)
        while True:
            with self.lock:
                r = next(stream, None)
            if r is None:
                return
            s = r.stats
            chunk = pb.GenerateChunk(session_id="s", text=r.text, token_ids=r.token_ids, round=pb.RoundStats(
                index=s.index, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
                committed=s.committed, draft_ms=s.draft_ms, verify_ms=s.verify_ms))
            if r.finish_reason:
                chunk.final.CopyFrom(pb.Final(finish_reason=r.finish_reason, tau=r.totals.tau, rounds=r.totals.rounds))
            yield chunk


@pytest.fixture
def serve():
    servers = []

    def start(servicer) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(grace=None)


def test_service_method_equals_target_and_load_mode(engines, serve, tmp_path, capsys):
    engine, baseline = engines
    address = serve(EngineServicer(engine))
    prompt = engine.encode(PROMPTS[1])
    via_service = ServiceMethod("svc", address, block_size=16).run(prompt, 24, 0.0, 0)
    alone = EngineMethod("alone", baseline, 1).run(prompt, 24, 0.0, 0)
    assert via_service.token_ids == alone.token_ids and via_service.committed and via_service.ttft_s > 0
    result = run_sweep(SweepSettings(address, (3,), requests_per_stream=1, max_new_tokens=4), [prompt, PROMPTS[0]])
    assert [(c["method"], c["concurrency"]) for c in result["cells"]] == [("dflash", 3), ("target-only", 3)]
    for cell in result["cells"]:  # a sweep of one: no c=1 to compare with
        assert cell["requests"] == 3 and cell["errors"] == 0 and cell["tokens_per_s"] > 0
        assert cell["ttft_ms"]["p50"] <= cell["ttft_ms"]["p99"] and cell["speedup_vs_c1"] is None
    assert main(["bench", "--load", "2", "--service", address, "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_load_mode_passes(engines, serve, tmp_path, capsys):
    """--passes 3: the sweep three times over the real service, cells the median pass, every pass kept."""
    address = serve(EngineServicer(engines[0]))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    assert main(["bench", "--load", "1,2", "--service", address, "--passes", "3", "--requests-per-stream", "1",
                 "--max-new-tokens", "4", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "load.json").read_text())
    assert result["settings"]["passes"] == 3 and len(result["passes"]) == 3
    orders = [[c["method"] for c in cells] for cells in result["passes"]]  # each pass starts with the other
    assert orders[0] == orders[2] == ["dflash", "target-only", "target-only", "dflash"] != orders[1]
    for cell in result["cells"]:
        runs = [c["tokens_per_s"] for cells in result["passes"] for c in cells
                if (c["method"], c["concurrency"]) == (cell["method"], cell["concurrency"])]
        assert cell["tokens_per_s_passes"] == runs and cell["tokens_per_s"] == sorted(runs)[1]
    out = capsys.readouterr().out
    assert "3 passes: each cell its median pass" in out and "18 requests" in out  # 3 x (1 + 1 + 2 + 2)
    assert main(["bench", "--load", "1", "--service", address, "--passes", "0"]) == 2
    assert "--passes" in capsys.readouterr().err


def test_merge_passes_takes_medians_of_paired_ratios():
    from dflash.bench.load import merge_passes

    def cell(method, c, tok_s, ttft):
        return {"method": method, "concurrency": c, "tokens_per_s": tok_s, "ttft_ms": {"p50": ttft}}

    passes = [[cell("dflash", 1, 100.0, 1), cell("target-only", 1, 50.0, 2)],
              [cell("dflash", 1, 60.0, 3), cell("target-only", 1, 40.0, 4)],  # a slow pass: both slower
              [cell("dflash", 1, 90.0, 5), cell("target-only", 1, 45.0, 6)]]
    merged = merge_passes(passes)
    by = {c["method"]: c for c in merged["cells"]}
    assert by["dflash"]["tokens_per_s"] == 90.0 and by["dflash"]["ttft_ms"]["p50"] == 5  # one real pass
    assert by["target-only"]["tokens_per_s_passes"] == [50.0, 40.0, 45.0] and by["target-only"]["tokens_per_s"] == 45
    assert merged["ratios"]["dflash/target-only"] == {"1": 2.0}  # median of 2.0, 1.5, 2.0 (not 90 / 45 by luck)
    assert merged["passes"] == passes


def test_load_mode_counts_errors(engines, serve, tmp_path, capsys):
    address = serve(EngineServicer(engines[0], abort=True))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x = 1"}) + "\n")
    assert main(["bench", "--load", "2", "--service", address, "--duration", "5", "--prompts",
                 str(tmp_path / "p.jsonl"), "--out", str(tmp_path)]) == 0
    cells = json.loads((tmp_path / "load.json").read_text())["cells"]
    assert len(cells) == 2
    for cell in cells:
        assert cell["error_codes"] == {"RESOURCE_EXHAUSTED": 4} and cell["requests"] == cell["errors"] == 4
        assert cell["completed"] == cell["tokens"] == 0
    assert "RESOURCE_EXHAUSTED" in capsys.readouterr().out


# -- the load sweep against the real service: the Ingress over a Verifier on the tiny models -----------


@pytest.fixture(scope="module")
def real_service(model_dirs):  # noqa: F811
    """"127.0.0.1:port" of the real Ingress + Verifier (colocated drafter, block 8) on a grpc.aio server."""
    target, drafter = model_dirs
    config = ServiceConfig.from_dict({
        "model": {"target": str(target), "drafter": str(drafter), "device": "cpu", "dtype": "float32", "name": "tiny"},
        "redis": {"url": "memory://"}, "metrics": "none"})
    store = MemorySessionStore()
    servicer = IngressServicer(Ingress(config), Verifier(build_verifier_engine(config, store, None), store, "tiny"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_load_sweep_against_the_real_service(real_service, dirs, tmp_path, capsys):
    out = tmp_path / "load"
    assert main(["bench", "--load", "1,2", "--service", real_service, "--prompts", str(dirs / "prompts.jsonl"),
                 "--max-new-tokens", "12", "--requests-per-stream", "2", "--out", str(out)]) == 0
    data = json.loads((out / "load.json").read_text())
    cells = {(c["method"], c["concurrency"]): c for c in data["cells"]}
    # interleaved, the order alternating from one concurrency to the next
    assert list(cells) == [("dflash", 1), ("target-only", 1), ("target-only", 2), ("dflash", 2)]
    for (_method, c), cell in cells.items():
        assert cell["errors"] == 0 and cell["requests"] == cell["completed"] == 2 * c, cell
        assert cell["tokens"] == 12 * cell["requests"]  # ignore_eos: the same work for every method
        assert cell["tokens_per_s"] > 0 and cell["speedup_vs_c1"] > 0 and cell["tau"] >= 1.0
        assert 0 < cell["ttft_ms"]["p50"] <= cell["ttft_ms"]["p99"]
        assert 0 < cell["tpot_ms"]["p50"] <= cell["tpot_ms"]["p99"]
    assert cells["dflash", 1]["speedup_vs_c1"] == cells["target-only", 1]["speedup_vs_c1"] == 1.0
    assert cells["target-only", 1]["tau"] == cells["target-only", 2]["tau"] == 1.0
    ratios = data["ratios"]["dflash/target-only"]
    assert set(ratios) == {"1", "2"} and all(r > 0 for r in ratios.values())
    settings = data["settings"]
    assert settings["concurrencies"] == [1, 2] and settings["requests_per_stream"] == 2 and "token" not in settings
    assert settings["max_new_tokens"] == 12 and settings["ignore_eos"] and data["machine"]["cpu_count"]
    assert "--load 1,2" in data["command"] and data["prompts"] == len(PROMPTS)
    assert (out / "load.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert printed.startswith("| c | dflash tok/s | dflash x vs c=1 |")
    assert "dflash/target-only aggregate tok/s: c=1" in printed
    assert "errors: none" in printed


def test_sweep_numbers_and_table_on_hand_made_records():
    def rec(ttft_s, decode_s, committed):
        return Record(token_ids=[5] * (1 + sum(committed)), ttft_s=ttft_s, decode_s=decode_s, first_chunk=1,
                      committed=list(committed), finished=True)

    fast, slow = rec(0.010, 0.9, [3, 3, 3]), rec(0.030, 0.9, [3, 3, 3])  # 10 tokens each, TPOT 100 ms
    target = rec(0.010, 1.8, [1] * 9)
    cells = [summarize_cell("dflash", 1, [fast, slow], 2.0), summarize_cell("target-only", 1, [target] * 2, 4.0),
             summarize_cell("dflash", 2, [fast, slow] * 2, 2.5),
             summarize_cell("target-only", 2, [target, target, Record(error="RESOURCE_EXHAUSTED: overloaded")], 5.0)]
    add_speedups(cells)
    d1, t1, d2, t2 = cells
    assert d1["tokens_per_s"] == 10.0 and d1["ttft_ms"] == {"p50": 20.0, "p99": 29.8} and d1["tau"] == 3.0
    assert d1["tpot_ms"] == {"p50": 100.0, "p99": 100.0} and t1["tpot_ms"]["p50"] == 200.0 and t1["tau"] == 1.0
    assert d2["speedup_vs_c1"] == 1.6 and t2["speedup_vs_c1"] == 0.8 and t2["tokens_per_s"] == 4.0
    assert t2["errors"] == 1 and t2["error_codes"] == {"RESOURCE_EXHAUSTED": 1} and t2["completed"] == 2
    result = {"settings": SweepSettings("x:1", (1, 2), max_new_tokens=10, token="secret").public(), "cells": cells,
              "ratios": method_ratios(cells)}
    assert result["ratios"] == {"dflash/target-only": {"1": 2.0, "2": 4.0}} and "token" not in result["settings"]
    text = format_sweep(result)
    lines = text.splitlines()
    assert lines[0] == ("| c | dflash tok/s | dflash x vs c=1 | dflash TTFT p50/p99 ms | dflash TPOT p50/p99 ms "
                        "| target-only tok/s | target-only x vs c=1 | target-only TTFT p50/p99 ms "
                        "| target-only TPOT p50/p99 ms |")
    assert lines[2] == "| 1 | 10.0 | 1.00x | 20.0 / 29.8 | 100.0 / 100.0 | 5.0 | 1.00x | 10.0 / 10.0 | 200.0 / 200.0 |"
    assert lines[3].startswith("| 2 | 16.0 | 1.60x | 20.0 / 30.0 |") and "| 4.0 | 0.80x |" in lines[3]
    assert "dflash/target-only aggregate tok/s: c=1 2.00x, c=2 4.00x" in text
    assert "dflash mean tau: c=1 3.00, c=2 3.00" in text
    assert "errors: target-only c=2 {'RESOURCE_EXHAUSTED': 1}" in text


@pytest.mark.parametrize("flags, message", [
    (["--methods", "target,nope"], "unknown ['nope']"),
    (["--temperatures", "0,hot"], "--temperatures"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["--load", "2"], "--load needs --service"),
    (["--load", "1,0"], "--load: concurrencies must be positive"),
    (["--load", "1,two"], "--load: expected concurrencies"),
    (["--load", "2", "--requests-per-stream", "0"], "--requests-per-stream must be positive"),
])
def test_bad_arguments_are_refused_before_loading(flags, message, capsys):
    assert main(["bench", *flags]) == 2
    assert message in capsys.readouterr().err


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([0.0, 10.0], 99) == 9.9


def test_gpu_scale_script_runs_tiny(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_scale.py"), "--tiny", "--iters", "2",
                           "--out", str(out)], check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    costs = result["costs_ms"]
    assert {f"verify_{k}" for k in (1, 4, 8, 16)} | {"draft_4", "draft_8", "draft_16", "round_16_t0"} <= set(costs)
    assert set(result["speedups"]) == {"greedy (paper average, Qwen3-8B)", "T=1 (paper average, Qwen3-8B)"}
    assert "verify_goal_<=1.15" in result["goals"] and "| at the paper's tau |" in proc.stdout
    # the batched sweep: packed target forwards of B sessions x q tokens, the batched drafter, the projection
    batched = result["batched"]
    label = "projection at the paper's tau, random weights"
    assert batched["label"] == batched["projection"]["label"] == label and label in proc.stdout
    assert batched["batches"] == [1, 2, 4, 8, 16, 32] and batched["verify_tokens"] == [1, 4, 8, 16]
    keys = {str(b) for b in batched["batches"]}
    assert set(batched["target_ms"]) == set(batched["baseline_ms"]) == set(batched["draft_ms"]) == keys
    assert all(set(row) == {"1", "4", "8", "16"} for row in batched["target_ms"].values())
    assert all(cell["median"] > 0 and cell["n"] == 2 for row in batched["target_ms"].values() for cell in row.values())
    proj = batched["projection"]
    assert proj["tau"] == 6.49 and [r["batch"] for r in proj["rows"]] == batched["batches"]
    for r in proj["rows"]:
        b = str(r["batch"])
        t16, draft = batched["target_ms"][b]["16"]["median"], batched["draft_ms"][b]["median"]
        assert r["dflash_tokens_per_s"] == pytest.approx(r["batch"] * 6.49 / ((t16 + draft) / 1000), abs=0.06)
        assert r["baseline_tokens_per_s"] == pytest.approx(r["batch"] / (batched["baseline_ms"][b]["median"] / 1000),
                                                           abs=0.06)
        if r["batch"] == 1:  # no half batch: nothing to pipeline
            assert r["pipelined_tokens_per_s"] is None and r["pipelined_over_serial"] is None
            continue
        half = str(r["batch"] // 2)  # two cohorts of B/2 taking turns: a round every two half steps
        step = max(batched["target_ms"][half]["16"]["median"], batched["draft_ms"][half]["median"])
        assert r["pipelined_tokens_per_s"] == pytest.approx(r["batch"] * 6.49 / (2 * step / 1000), abs=0.06)
    best = proj["best_verify"]
    assert 0.8 < best["acceptance_p"] < 0.9 and "geometric" in best["label"] and label in best["label"]
    for r, b in zip(best["rows"], proj["rows"]):
        assert 1 <= r["verify_tokens"] <= 16 and r["tokens_per_s"] >= max(b["dflash_tokens_per_s"],
                                                                           b["baseline_tokens_per_s"]) - 0.1
    assert "| B | target q=1 ms |" in proc.stdout and "best q (geometric)" in proc.stdout
    assert "pipelined tok/s (bound)" in proc.stdout


def test_anchor_difficulty_script_runs_on_the_demo_pair():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "anchor_difficulty.py"), "--num-prompts", "2",
                           "--tokens", "24", "--threads", "1"], check=False, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    everywhere, visited = result["all_positions"], result["round_anchors"]
    assert everywhere["anchors"] == 2 * 23 and visited["anchors"] == result["rounds"] <= everywhere["anchors"]
    assert 1.0 <= result["replayed_tau"] <= 16.0
    for part in (everywhere, visited):
        assert abs(sum(b["share"] for b in part["by_target_p_anchor"].values()) - 1.0) < 0.01


def test_transformers_dflash_method_runs_our_drafter_in_transformers_generate():
    """The `hfdflash` method: transformers' own DFlash loop on our drafter's weights, converted exactly;
    a drafter it cannot run exactly is an unavailable row naming the field."""
    from dflash.bench.methods import TRANSFORMERS_DFLASH, build_methods
    from dflash.drafter import DFlashConfig, DFlashDraftModel
    from tiny import MASK_ID, hf_greedy, prompts

    target = tiny_target("qwen3")
    engine, baseline = engine_for(target, tiny_drafter(target, block_size=8)), engine_for(target)
    methods, unavailable = build_methods(["hfdflash"], engine, baseline, "no AR draft", None)
    assert not unavailable and [m.name for m in methods] == [TRANSFORMERS_DFLASH]
    prompt = prompts(1, seed=6)[0]
    sample = methods[0].run(prompt, 24, 0.0, 0)
    assert sample.token_ids == hf_greedy(target, prompt, 24) and sample.first_chunk == 1
    assert sum(sample.committed) == len(sample.token_ids) - 1 and sample.draft_s > 0 and sample.verify_s > 0
    raw = DFlashConfig.for_target(target.config, block_size=8, mask_token_id=MASK_ID, num_features=2).raw
    sliding = DFlashDraftModel(DFlashConfig.from_dict({**raw, "layer_types": ["sliding_attention"],
                                                       "sliding_window": 4})).eval()
    _, unavailable = build_methods(["hfdflash"], engine_for(target, sliding), baseline, "no AR draft", None)
    assert "sliding_window" in unavailable[TRANSFORMERS_DFLASH]


def test_gpu_scale_measures_a_trained_pair(tmp_path):
    """--demo: the same costs on the shipped pair (one CPU thread), tau measured instead of the paper's."""
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_scale.py"), "--demo", "--batches", "1,2",
                           "--iters", "2", "--warmup", "0", "--batch-iters", "1", "--tau-prompts", "1",
                           "--out", str(out)], check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    [(label, speedups)] = result["speedups"].items()
    assert result["tau_kind"] == "measured" and label.startswith("greedy (measured") and speedups["tau"] > 1
    assert "speedup_goal_>5_at_tau_6.49" not in result["goals"] and "| at the measured tau |" in proc.stdout
    proj = result["batched"]["projection"]
    assert proj["tau"] == speedups["tau"] and proj["label"] == "projection at the measured tau, trained weights"
    assert proj["rows"][1]["pipelined_tokens_per_s"] > 0 and result["drafter_layers"] == 3
