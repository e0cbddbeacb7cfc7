"""What one DFlash round costs at real scale on a GPU, and the speedup that implies, at batch 1 and batched.

Random weights, real shapes: a Qwen3-8B-shaped target (36 layers, hidden 4096, bf16) and a 5-layer
DFlash drafter built by `DFlashConfig.for_target(..., num_layers=5)`. Acceptance of random weights is
nil, so the speedup is computed from measured costs at the paper's acceptance lengths:
speedup = tau * (target-only step) / (DFlash round). Every cost goes through the project's own code
(TargetModel, KVCache, LocalDrafter, SpeculativeEngine), so Python overhead counts as it would in use.

The batched sweep times one packed target forward of B sessions x q tokens (each session with its own
cached context, cropped back after each forward) and the drafter's batched forward (`draft_batch`,
block 16) for B sessions, and projects aggregate tokens/s at the paper's tau against plain batched
decoding (one token per session per forward): DFlash = B * tau / (t_target(B, 16) + t_draft(B)),
plain = B / t_target(B, 1) (the target without features). It also picks the best verify length per B
from the same measured curve under a geometric acceptance model fitted to tau. These are projections
at the paper's tau with random weights, not measured throughput of a trained pair.

From the same curve it projects drafting beside verification (draft_pipeline.py, remote drafters on
their own device): the sessions split into two cohorts of B/2 that take turns, so each session gets a
round every two steps of max(t_target(B/2, 16), t_draft(B/2)): pipelined DFlash = B * tau /
(2 * max(...)). That is an upper bound (no transport, no contention between the two devices); it beats
the serial step only where halving the batch about halves both costs.

With `--target/--drafter` (or `--demo`, the built-in pair) the same costs are measured on a trained
pair, on `--device`, and tau is measured on held-out prompts with every proposal verified.

    python benchmarks/gpu_scale.py --out benchmarks/gpu_scale_h200.json   # on the GPU (about 2 minutes)
    python benchmarks/gpu_scale.py --tiny                                  # the same code, tiny, on CPU
    python benchmarks/gpu_scale.py --demo --batches 1,2,4,8,16            # the demo pair, one CPU thread
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from dflash.bench.profile_round import prefill_one
from dflash.drafter import DFlashConfig, DFlashDraftModel
from dflash.drafter.local import LocalDrafter
from dflash.drafter.protocol import DraftRequest
from dflash.engine import SpeculativeEngine
from dflash.generation import Generation
from dflash.params import SamplingParams
from dflash.scheduler import SchedulerConfig
from dflash.target import ForwardItem, TargetModel
from transformers import Qwen3Config, Qwen3ForCausalLM

PAPER_TAU = {"greedy (paper average, Qwen3-8B)": (0.0, 6.49), "T=1 (paper average, Qwen3-8B)": (1.0, 5.48)}
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_theta=1_000_000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
VERIFY_SIZES = (1, 4, 8, 16)
DRAFT_SIZES = (4, 8, 16)
BATCHES = (1, 2, 4, 8, 16, 32)
BATCH_VERIFY = (1, 4, 8, 16)  # tokens per session in one packed target forward (q)
BLOCK = 16  # the drafter's block, what the engine always drafts
GREEDY_TAU = "greedy (paper average, Qwen3-8B)"
PROJECTION = "projection at the paper's tau, random weights"
PREFILL_TOKENS = 4096  # at most this many tokens in one set-up (prefill) forward


def random_init(module: torch.nn.Module, seed: int) -> None:
    """Weights N(0, 0.02), norms 1: the constructor's own init is not relied on (it may leave memory as is)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02)
                        if p.device.type == "cpu" else torch.randn_like(p, dtype=torch.float32).mul_(0.02))


def build(shape: dict, num_layers: int, block_size: int, device: torch.device, dtype: torch.dtype):
    """The target (HF Qwen3) and the DFlash drafter, random, directly on `device` in `dtype`."""
    config = Qwen3Config(**shape)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target = Qwen3ForCausalLM(config).eval()
            draft_config = DFlashConfig.for_target(config, num_layers=num_layers, block_size=block_size,
                                                   mask_token_id=shape["vocab_size"] - 1)
            drafter = DFlashDraftModel(draft_config).eval()
    finally:
        torch.set_default_dtype(previous)
    random_init(target, 0)
    random_init(drafter, 1)
    return target, drafter  # built in dtype; RoPE frequencies stay float32 as in from_pretrained


class Clock:
    """Wall time in ms of a call, with the device drained before and after."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn, iters: int, warmup: int) -> dict:
        times = []
        for i in range(warmup + iters):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            if i >= warmup:
                times.append(1000 * (time.perf_counter() - t0))
        return {"median": round(statistics.median(times), 4), "min": round(min(times), 4), "n": len(times)}


@torch.inference_mode()
def measure_verify(target: TargetModel, plain: TargetModel, context: int, clock: Clock, iters, warmup) -> dict:
    """Target forward of k tokens after `context` cached positions (features on, as DFlash verifies);
    `step_1` is the target alone (no features), the baseline's step."""
    vocab, session, most = target.vocab_size, "verify", context + max(VERIFY_SIZES)
    cache = target.new_cache(most)
    cache.reserve(session, most)
    plain.forward(cache, [ForwardItem(session, _random_ids(vocab, context), 0, last_only=True)])
    out = {}
    for k in VERIFY_SIZES:
        items = [ForwardItem(session, _random_ids(vocab, k), context)]
        out[f"verify_{k}"] = clock.ms(partial(_forward_and_crop, target, cache, items, context), iters, warmup)
    out["step_1"] = clock.ms(partial(_forward_and_crop, plain, cache, [ForwardItem(session, (1,), context)], context),
                             iters, warmup)
    cache.free(session)
    return out


def _random_ids(vocab: int, n: int, generator: torch.Generator | None = None) -> tuple[int, ...]:
    return tuple(torch.randint(0, vocab - 1, (n,), generator=generator).tolist())


def _forward_and_crop(model: TargetModel, cache, items: list[ForwardItem], context: int) -> None:
    """One packed forward onto sessions holding `context` positions, then every session back to `context`."""
    model.forward(cache, items)
    for item in items:
        cache.crop(item.session_id, context)


@torch.inference_mode()
def measure_draft(drafter: LocalDrafter, context: int, features: int, new_context: int, clock: Clock, iters,
                  warmup) -> dict:
    """One drafter call per block size, after `context` positions are cached; each call brings
    `new_context` newly committed positions (about tau), as in decoding."""
    device, dtype = drafter.embed_tokens.weight.device, drafter.embed_tokens.weight.dtype
    out = {}
    for size in DRAFT_SIZES:
        session = f"draft-{size}"
        drafter.draft_batch([DraftRequest(session, torch.randn(context, features, device=device, dtype=dtype), 0, 1,
                                          size)])
        reached = [context]  # the position the session's context reaches, advanced by each call
        new = torch.randn(new_context, features, device=device, dtype=dtype)
        out[f"draft_{size}"] = clock.ms(partial(_draft_next, drafter, [session], new, reached, size), iters, warmup)
        drafter.release(session)
    return out


def _draft_next(drafter: LocalDrafter, sessions: list[str], new: torch.Tensor, reached: list[int], size: int) -> None:
    """One batched drafter forward: every session brings `new` context rows and drafts a block of `size`."""
    drafter.draft_batch([DraftRequest(s, new, reached[i], 1, size) for i, s in enumerate(sessions)])
    for i in range(len(sessions)):
        reached[i] += new.shape[0]


def _round(engine: SpeculativeEngine, gen: Generation) -> None:
    """One engine step; with one running session, one round of it."""
    engine.step()
    if gen.error is not None:
        raise gen.error
    gen.outbox.clear()


@torch.inference_mode()
def measure_rounds(engine: SpeculativeEngine, baseline: SpeculativeEngine, context: int, clock: Clock, iters,
                   warmup) -> dict:
    """Full engine rounds (`step` with one session running): DFlash at block 16 and 8, the target alone
    at block 1; T=0 and T=1."""
    prompt = torch.randint(0, engine.target.vocab_size - 1, (context,)).tolist()
    out = {}
    for name, eng, block in (("round_16", engine, 16), ("round_8", engine, 8), ("target_step", baseline, 1)):
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_new_tokens=(iters + warmup + 2) * block, temperature=temperature, seed=0,
                                    block_size=block, ignore_eos=True)
            gen = eng.start(prompt, params)
            eng.submit(gen)
            try:
                prefill_one(eng, gen)
                out[f"{name}_t{temperature:g}"] = clock.ms(partial(_round, eng, gen), iters, warmup)
            finally:
                eng.cancel(gen)
    return out


@torch.inference_mode()
def measure_batched(target: TargetModel, plain: TargetModel, drafter: LocalDrafter, context: int, features: int,
                    new_context: int, batches: tuple[int, ...], clock: Clock, iters, warmup,
                    label: str = PROJECTION) -> dict:
    """Packed target forwards of B sessions x q tokens (features on), the plain target at q = 1, and the
    drafter's batched forward for B sessions at block 16; every session has its own `context` positions."""
    vocab, most, qmax = target.vocab_size, max(batches), max(BATCH_VERIFY)
    device, dtype = drafter.embed_tokens.weight.device, drafter.embed_tokens.weight.dtype
    g = torch.Generator(device="cpu").manual_seed(0)
    sessions = [f"batch-{i}" for i in range(most)]
    cache = target.new_cache(most * (context + qmax), most)
    for s in sessions:
        cache.reserve(s, context + qmax)
    per = max(1, PREFILL_TOKENS // max(context, 1))
    for i in range(0, most, per):  # prefill every session once (the cache's keys are what matter, not features)
        plain.forward(cache, [ForwardItem(s, _random_ids(vocab, context, g), 0, last_only=True)
                              for s in sessions[i : i + per]])
    target_ms: dict[str, dict] = {}
    baseline_ms: dict[str, dict] = {}
    for b in batches:
        row = {}
        for q in BATCH_VERIFY:
            items = [ForwardItem(s, _random_ids(vocab, q, g), context) for s in sessions[:b]]
            row[str(q)] = clock.ms(partial(_forward_and_crop, target, cache, items, context), iters, warmup)
        target_ms[str(b)] = row
        items = [ForwardItem(s, _random_ids(vocab, 1, g), context) for s in sessions[:b]]
        baseline_ms[str(b)] = clock.ms(partial(_forward_and_crop, plain, cache, items, context), iters, warmup)
    for s in sessions:
        cache.free(s)
    del cache

    drafts = [f"batch-draft-{i}" for i in range(most)]
    for i in range(0, most, per):  # every drafter session holds `context` positions first
        drafter.draft_batch([DraftRequest(s, torch.randn(context, features, device=device, dtype=dtype),
                                          0, 1, BLOCK) for s in drafts[i : i + per]])
    reached = [context] * most
    new = torch.randn(new_context, features, device=device, dtype=dtype)
    draft_ms = {}
    for b in batches:
        sub = reached[:b]
        draft_ms[str(b)] = clock.ms(partial(_draft_next, drafter, drafts[:b], new, sub, BLOCK), iters, warmup)
        reached[:b] = sub
    for s in drafts:
        drafter.release(s)
    return {"label": label, "context": context, "block_size": BLOCK, "new_context_per_draft": new_context,
            "batches": list(batches), "verify_tokens": list(BATCH_VERIFY), "iters": iters, "warmup": warmup,
            "target_ms": target_ms, "baseline_ms": baseline_ms, "draft_ms": draft_ms}


def expected_committed(p: float, k: int) -> float:
    """Tokens a round commits verifying k drafts when each is accepted with probability p given the ones
    before it (the bonus token included): 1 + p + p^2 + ... + p^k."""
    return sum(p**j for j in range(k + 1))


def fit_acceptance(tau: float, drafts: int) -> float:
    """The p of the geometric model whose expected committed tokens at `drafts` drafts equal tau."""
    if tau >= drafts + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_committed(mid, drafts) < tau else (lo, mid)
    return (lo + hi) / 2


def interpolate(points: list[tuple[int, float]], x: int) -> float:
    """Linear interpolation between measured (q, ms) points (the measured value at a measured q)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise ValueError(f"q = {x} is outside the measured {points[0][0]}..{points[-1][0]}")


def pipelined_tokens_per_s(batched: dict, b: int, tau: float) -> float | None:
    """DFlash tok/s of B sessions in two cohorts of B/2 taking turns (one verified while the other is
    drafted on another device): B * tau / (2 * max(t_target(B/2, 16), t_draft(B/2))); None when B/2
    was not measured."""
    half = str(b // 2)
    if b % 2 or half not in batched["draft_ms"]:
        return None
    step = max(batched["target_ms"][half][str(batched["block_size"])]["median"], batched["draft_ms"][half]["median"])
    return b * tau / (2 * step / 1000)


def project_batched(batched: dict, tau: float, tau_source: str = GREEDY_TAU) -> dict:
    """Aggregate tokens/s per batch, DFlash at tau (block 16) vs plain batched decoding, the two-cohort
    pipelined bound, and the best verify length per batch under the geometric model (times between
    measured q interpolated linearly)."""
    block, label = batched["block_size"], batched["label"]
    p = fit_acceptance(tau, block - 1)
    rows, best = [], []
    for b in batched["batches"]:
        t_q = batched["target_ms"][str(b)]
        t_block, t_draft = t_q[str(block)]["median"], batched["draft_ms"][str(b)]["median"]
        plain = b / (batched["baseline_ms"][str(b)]["median"] / 1000)
        dflash = b * tau / ((t_block + t_draft) / 1000)
        piped = pipelined_tokens_per_s(batched, b, tau)
        rows.append({"batch": b, "baseline_tokens_per_s": round(plain, 1), "dflash_tokens_per_s": round(dflash, 1),
                     "speedup": round(dflash / plain, 3),
                     "pipelined_tokens_per_s": None if piped is None else round(piped, 1),
                     "pipelined_over_serial": None if piped is None else round(piped / dflash, 3)})
        curve = partial(interpolate, sorted((int(q), v["median"]) for q, v in t_q.items()))
        options = [(plain, 1, 1.0)]  # q = 1: no draft, plain decoding
        for q in range(2, block + 1):
            committed = expected_committed(p, q - 1)
            options.append((b * committed / ((curve(q) + t_draft) / 1000), q, committed))
        tps, q, committed = max(options)
        best.append({"batch": b, "verify_tokens": q, "expected_committed": round(committed, 3),
                     "tokens_per_s": round(tps, 1), "speedup": round(tps / plain, 3)})
    model = (f"geometric acceptance: each draft accepted with p = {p:.4f} given the ones before (fitted so that "
             f"{block - 1} drafts commit tau = {tau} tokens); target time at q between measured points "
             "interpolated linearly; q = 1 is plain decoding (no draft)")
    return {"label": label, "tau": tau, "tau_source": f"{tau_source}, block {block}",
            "formula": "DFlash tok/s = B * tau / (t_target(B, 16) + t_draft(B)); plain tok/s = B / t_target(B, 1); "
                       "pipelined (two cohorts, drafter on its own device) = B * tau / (2 * max(t_target(B/2, 16), "
                       "t_draft(B/2)))",
            "rows": rows, "best_verify": {"label": f"{label}; {model}", "acceptance_p": round(p, 4), "rows": best}}


def implied(costs: dict, taus: dict[str, tuple[float, float]] = PAPER_TAU) -> dict:
    """Speedups at each (temperature, tau) of `taus` (the paper's by default), from full rounds and from
    the network costs alone; the goals, at the first (greedy) tau."""
    res = {}
    for label, (temperature, tau) in taus.items():
        t = f"t{temperature:g}"
        round_16, step = costs[f"round_16_{t}"]["median"], costs[f"target_step_{t}"]["median"]
        res[label] = {"tau": tau, "speedup_engine": round(tau * step / round_16, 3),
                      "speedup_networks_only": round(tau * costs["step_1"]["median"]
                                                     / (costs["draft_16"]["median"] + costs["verify_16"]["median"]), 3)}
    v1, v16 = costs["verify_1"]["median"], costs["verify_16"]["median"]
    goals = {
        "verify_16_over_verify_1": round(v16 / v1, 3), "verify_goal_<=1.15": v16 / v1 <= 1.15,
        "draft_16_over_target_step": round(costs["draft_16"]["median"] / costs["step_1"]["median"], 3),
        "draft_goal_<0.15": costs["draft_16"]["median"] / costs["step_1"]["median"] < 0.15,
    }
    if taus is PAPER_TAU:
        goals["speedup_goal_>5_at_tau_6.49"] = res[GREEDY_TAU]["speedup_engine"] > 5
    return {"speedups": res, "goals": goals}


def markdown(result: dict) -> str:
    c = result["costs_ms"]
    head = (f"{result['machine']['device']}, {result['shape']} target, {result['drafter_layers']}-layer drafter, "
            f"{result['dtype']}, context {result['context']} tokens (median ms of {c['verify_1']['n']})")
    lines = [head, "", "| cost | ms |", "|---|---|"]
    lines += [f"| target forward, {k} token(s) (DFlash verify) | {c[f'verify_{k}']['median']:.3f} |"
              for k in VERIFY_SIZES]
    lines.append(f"| target-only step (1 token, no features) | {c['step_1']['median']:.3f} |")
    lines += [f"| draft, block {b} | {c[f'draft_{b}']['median']:.3f} |" for b in DRAFT_SIZES]
    for t in ("0", "1"):
        lines += [f"| engine round, DFlash block 16, T={t} | {c[f'round_16_t{t}']['median']:.3f} |",
                  f"| engine round, DFlash block 8, T={t} | {c[f'round_8_t{t}']['median']:.3f} |",
                  f"| engine round, target alone, T={t} | {c[f'target_step_t{t}']['median']:.3f} |"]
    lines += ["", f"| at the {result['tau_kind']} tau | tau | speedup (engine rounds) | speedup (networks only) |",
              "|---|---|---|---|"]
    for label, s in result["speedups"].items():
        lines.append(f"| {label} | {s['tau']} | {s['speedup_engine']:.2f}x | {s['speedup_networks_only']:.2f}x |")
    lines += ["", "Goals: " + ", ".join(f"{k} = {v}" for k, v in result["goals"].items())]
    if "batched" in result:
        lines += ["", markdown_batched(result["batched"])]
    return "\n".join(lines)


def markdown_batched(batched: dict) -> str:
    proj, qs = batched["projection"], batched["verify_tokens"]
    best = {r["batch"]: r for r in proj["best_verify"]["rows"]}
    lines = [f"Batched: B sessions x q tokens in one packed target forward, each session with {batched['context']} "
             f"cached tokens; drafter: one batched forward at block {batched['block_size']} with "
             f"{batched['new_context_per_draft']} new context rows per session (median ms of {batched['iters']}). "
             f"Tokens/s: {batched['label']} (tau {proj['tau']}).", "",
             "| B | " + " | ".join(f"target q={q} ms" for q in qs) + " | plain q=1 ms | draft ms "
             "| plain tok/s | DFlash tok/s (projected) | x | best q (geometric) | tok/s at best q | x "
             "| pipelined tok/s (bound) | x serial DFlash |",
             "|---" * (len(qs) + 11) + "|"]
    for r in proj["rows"]:
        b, key = r["batch"], str(r["batch"])
        t = batched["target_ms"][key]
        bq = best[b]
        lines.append(f"| {b} | " + " | ".join(f"{t[str(q)]['median']:.3f}" for q in qs)
                     + f" | {batched['baseline_ms'][key]['median']:.3f} | {batched['draft_ms'][key]['median']:.3f}"
                     f" | {r['baseline_tokens_per_s']:.1f} | {r['dflash_tokens_per_s']:.1f} | {r['speedup']:.2f}x"
                     f" | {bq['verify_tokens']} | {bq['tokens_per_s']:.1f} | {bq['speedup']:.2f}x"
                     + (" | - | - |" if r["pipelined_tokens_per_s"] is None else
                        f" | {r['pipelined_tokens_per_s']:.1f} | {r['pipelined_over_serial']:.2f}x |"))
    lines += ["", f"{proj['formula']}.", f"Best q: {proj['best_verify']['label']}."]
    return "\n".join(lines)


def parse_batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return tuple(sorted(set(values)))


def measured_pair(args: argparse.Namespace):
    """A trained pair through the project's loader, and its greedy tau with every proposal verified,
    measured on held-out prompts of the demo corpus."""
    from dflash.bench.inprocess import driven
    from dflash.defaults import demo_pair
    from dflash.demo.corpus import heldout_prompts
    from dflash.loading import build_engine

    target_dir, drafter_dir = demo_pair() if args.demo else (args.target, args.drafter)
    engine = build_engine(target_dir, drafter_dir, device=args.device, dtype=args.dtype,
                          scheduler=SchedulerConfig(verify_policy="full"))
    prompts = [engine.encode(t) for t in heldout_prompts(args.tau_prompts, seed=0)]
    tau = driven(engine, prompts, SamplingParams(max_new_tokens=128, ignore_eos=True), "dflash").tau
    label = f"greedy (measured, {len(prompts)} held-out prompts, 128 tokens)"
    return engine, round(tau, 3), label, Path(target_dir).name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU in float32 (tests the script)")
    p.add_argument("--demo", action="store_true", help="the built-in trained pair instead of random weights")
    p.add_argument("--target", help="a trained target directory (with --drafter) instead of random weights")
    p.add_argument("--drafter", help="its DFlash drafter directory")
    p.add_argument("--device", default="auto", help="device of a trained pair (default: CUDA if present)")
    p.add_argument("--dtype", default="auto", help="dtype of a trained pair (default: the loader's)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads with --tiny or a trained pair (default 1: what a CPU replica gets)")
    p.add_argument("--tau-prompts", type=int, default=8, help="held-out prompts tau is measured on (trained pair)")
    p.add_argument("--context", type=int, help="cached context tokens per session (default 512; --tiny 64; pair 200)")
    p.add_argument("--iters", type=int, help="timed repetitions (default 30; --tiny 3; pair 10)")
    p.add_argument("--warmup", type=int, help="untimed repetitions first (default 5; --tiny 1; pair 2)")
    p.add_argument("--new-context", type=int, default=7, help="context positions each draft call brings (about tau)")
    p.add_argument("--batches", type=parse_batches, default=BATCHES,
                   help="batch sizes of the batched sweep (default 1,2,4,8,16,32)")
    p.add_argument("--batch-iters", type=int, help="timed repetitions per batched cell (default 10; --tiny 2)")
    p.add_argument("--no-batched", action="store_true", help="skip the batched sweep")
    p.add_argument("--out", type=Path, help="write the JSON result here")
    args = p.parse_args(argv)
    pair = args.demo or args.target is not None
    if args.target is not None and args.drafter is None:
        p.error("--target needs --drafter")
    if not (args.tiny or pair) and not torch.cuda.is_available():
        print("gpu_scale: no CUDA device; use --tiny (or --demo) to run the same code on CPU", file=sys.stderr)
        return 2
    small = args.tiny or pair
    if small:
        torch.set_num_threads(args.threads)
    context = args.context or (64 if args.tiny else 200 if pair else 512)
    iters = args.iters or (3 if args.tiny else 10 if pair else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2 if pair else 5)
    batch_iters = args.batch_iters or (2 if small else 10)
    if pair:
        engine, tau, tau_label, shape = measured_pair(args)
        target, drafter = engine.target, engine.drafter
        plain = TargetModel(target.model)
        taus, tau_kind, label = {tau_label: (0.0, tau)}, "measured", "projection at the measured tau, trained weights"
        layers, dtype = len(drafter.model.layers), target.model.dtype
        features = drafter.model.fc.in_features
    else:
        dtype = torch.float32 if args.tiny else torch.bfloat16
        target_model, draft_model = build(TINY if args.tiny else QWEN3_8B, 5, BLOCK,
                                          torch.device("cpu" if args.tiny else "cuda"), dtype)
        target = TargetModel(target_model, draft_model.config.target_layer_ids)
        plain = TargetModel(target_model)
        drafter = LocalDrafter(draft_model, target.embed_tokens, target.lm_head)
        features = draft_model.config.hidden_size * len(draft_model.config.target_layer_ids)
        taus, tau_kind, label, layers = PAPER_TAU, "paper's", PROJECTION, 5
        shape = "tiny" if args.tiny else "Qwen3-8B"
    device = target.device
    clock = Clock(device)
    costs = measure_verify(target, plain, context, clock, iters, warmup)
    costs |= measure_draft(drafter, context, features, args.new_context, clock, iters, warmup)
    # "full": every round verifies its whole block, so a round's cost is the cost of its parts
    config = SchedulerConfig(verify_policy="full",
                             cache_tokens=max(1 << 16, 2 * (context + (iters + warmup + 3) * BLOCK)))
    costs |= measure_rounds(SpeculativeEngine(target, drafter, config=config),
                            SpeculativeEngine(plain, None, config=config), context, clock, iters, warmup)
    result = {"shape": shape, "drafter_layers": layers, "dtype": str(dtype).split(".")[-1],
              "context": context, "new_context_per_draft": args.new_context, "tau_kind": tau_kind,
              "machine": {"device": torch.cuda.get_device_name(0) if device.type == "cuda"
                          else f"{platform.processor() or 'CPU'}, {torch.get_num_threads()} torch thread(s)",
                          "torch": torch.__version__, "platform": platform.platform(),
                          "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
              "command": " ".join(["python benchmarks/gpu_scale.py", *(argv if argv is not None else sys.argv[1:])]),
              "costs_ms": costs, **implied(costs, taus)}
    if not args.no_batched:
        batched = measure_batched(target, plain, drafter, context, features, args.new_context, args.batches, clock,
                                  batch_iters, min(warmup, 2), label)
        greedy_label, (_, greedy_tau) = next(iter(taus.items()))
        batched["projection"] = project_batched(batched, greedy_tau, greedy_label)
        result["batched"] = batched
    print(markdown(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
