"""`dflash bench` on tiny models: the table, JSON, plots, greedy check, the round profile, the service
client and load mode against a loopback gRPC server, and the GPU-scale script in --tiny mode."""

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
from dflash.bench.load import LoadSettings, percentile, run_load
from dflash.bench.methods import EngineMethod, Sample, ServiceMethod
from dflash.bench.profile_round import PARTS, format_profile, profile_round
from dflash.bench.report import markdown_table, summarize
from dflash.bench.runner import BenchSettings, run_bench
from dflash.cli import main
from dflash.drafter.checkpoint import save_drafter
from dflash.params import SamplingParams
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
                 "DFlash block 8", "DFlash via service (gRPC)"):
        assert name in printed
    assert "| method | T | decode tok/s | speedup |" in printed and "draft forward (drafter layers)" in printed
    data = json.loads((out / "bench.json").read_text())
    rows = data["rows"]
    greedy = [r for r in rows if r.get("temperature") == 0.0 and "unavailable" not in r]
    assert len(greedy) == 7 and {r["temperature"] for r in rows if "unavailable" not in r} == {0.0, 1.0}
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
    assert not {"forward", "crop"} & set(vars(engine.target)) and "commit" not in vars(engine)
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
        opt = lambda f: getattr(request, f) if request.HasField(f) else None
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
    result = run_load(LoadSettings(address, clients=3, duration_s=3.0, max_new_tokens=4), [prompt, PROMPTS[0]])
    assert result["requests"] >= 3 and result["completed"] >= 1 and result["errors"] == {}
    assert result["tokens_per_s"] > 0 and result["ttft_ms"]["p50"] <= result["ttft_ms"]["p99"]
    assert main(["bench", "--load", "2", "--service", address, "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_load_mode_counts_errors(engines, serve, tmp_path, capsys):
    address = serve(EngineServicer(engines[0], abort=True))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x = 1"}) + "\n")
    assert main(["bench", "--load", "2", "--service", address, "--duration", "0.3", "--prompts",
                 str(tmp_path / "p.jsonl"), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "load.json").read_text())
    assert result["errors"].get("RESOURCE_EXHAUSTED", 0) == result["requests"] > 0 and result["completed"] == 0
    assert "RESOURCE_EXHAUSTED" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--methods", "target,nope"], "unknown ['nope']"),
    (["--temperatures", "0,hot"], "--temperatures"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["--load", "2"], "--load needs --service"),
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
