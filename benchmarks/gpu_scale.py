"""What one DFlash round costs at real scale on a GPU, and the speedup that implies.

Random weights, real shapes: a Qwen3-8B-shaped target (36 layers, hidden 4096, bf16) and a 5-layer
DFlash drafter built by `DFlashConfig.for_target(..., num_layers=5)`. Acceptance of random weights is
nil, so the speedup is computed from measured costs at the paper's acceptance lengths:
speedup = tau * (target-only step) / (DFlash round). Every cost goes through the project's own code
(TargetModel, LocalDrafter, SpeculativeEngine), so Python overhead counts as it would in use.

    python benchmarks/gpu_scale.py --out benchmarks/gpu_scale_h200.json   # on the GPU (about 2 minutes)
    python benchmarks/gpu_scale.py --tiny                                  # the same code, tiny, on CPU
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
from dflash.drafter import DFlashConfig, DFlashDraftModel
from dflash.drafter.local import LocalDrafter
from dflash.engine import SpeculativeEngine
from dflash.params import SamplingParams
from dflash.target import TargetModel
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
    vocab = target.vocab_size
    cache = target.new_cache()
    target.forward(torch.randint(0, vocab - 1, (context,)).tolist(), 0, cache, last_only=True)
    out = {}
    for k in VERIFY_SIZES:
        ids = torch.randint(0, vocab - 1, (k,)).tolist()
        out[f"verify_{k}"] = clock.ms(partial(_forward_and_crop, target, ids, context, cache), iters, warmup)
    out["step_1"] = clock.ms(partial(_forward_and_crop, plain, [1], context, cache), iters, warmup)
    return out


def _forward_and_crop(model: TargetModel, ids: list[int], context: int, cache) -> None:
    model.forward(ids, context, cache)
    model.crop(cache, context)


@torch.inference_mode()
def measure_draft(drafter: LocalDrafter, context: int, features: int, new_context: int, clock: Clock, iters,
                  warmup) -> dict:
    """One `draft` call per block size, after `context` positions are cached; each call brings
    `new_context` newly committed positions (about tau), as in decoding."""
    device, dtype = drafter.embed_tokens.weight.device, drafter.embed_tokens.weight.dtype
    out = {}
    for size in DRAFT_SIZES:
        session = f"draft-{size}"
        drafter.draft(session, torch.randn(context, features, device=device, dtype=dtype), 0, 1, size)
        reached = [context]  # the position the session's context reaches, advanced by each call
        new = torch.randn(new_context, features, device=device, dtype=dtype)
        out[f"draft_{size}"] = clock.ms(partial(_draft_next, drafter, session, new, reached, size), iters, warmup)
        drafter.release(session)
    return out


def _draft_next(drafter: LocalDrafter, session: str, new: torch.Tensor, reached: list[int], size: int) -> None:
    drafter.draft(session, new, reached[0], 1, size)
    reached[0] += new.shape[0]


@torch.inference_mode()
def measure_rounds(engine: SpeculativeEngine, baseline: SpeculativeEngine, context: int, clock: Clock, iters,
                   warmup) -> dict:
    """Full engine rounds (`step`): DFlash at block 16 and 8, the target alone at block 1; T=0 and T=1."""
    prompt = torch.randint(0, engine.target.vocab_size - 1, (context,)).tolist()
    out = {}
    for name, eng, block in (("round_16", engine, 16), ("round_8", engine, 8), ("target_step", baseline, 1)):
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_new_tokens=(iters + warmup + 2) * block, temperature=temperature, seed=0,
                                    block_size=block, ignore_eos=True)
            gen = eng.start(prompt, params)
            eng.prefill(gen)
            out[f"{name}_t{temperature:g}"] = clock.ms(partial(eng.step, gen), iters, warmup)
            eng.release(gen)
    return out


def implied(costs: dict) -> dict:
    """Speedups at the paper's tau, from full rounds and from the network costs alone; the goals."""
    res = {}
    for label, (temperature, tau) in PAPER_TAU.items():
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
        "speedup_goal_>5_at_tau_6.49": res["greedy (paper average, Qwen3-8B)"]["speedup_engine"] > 5,
    }
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
    lines += ["", "| at the paper's tau | tau | speedup (engine rounds) | speedup (networks only) |",
              "|---|---|---|---|"]
    for label, s in result["speedups"].items():
        lines.append(f"| {label} | {s['tau']} | {s['speedup_engine']:.2f}x | {s['speedup_networks_only']:.2f}x |")
    lines += ["", "Goals: " + ", ".join(f"{k} = {v}" for k, v in result["goals"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU in float32 (tests the script)")
    p.add_argument("--context", type=int, help="cached context tokens (default 512; --tiny 64)")
    p.add_argument("--iters", type=int, help="timed repetitions (default 30; --tiny 3)")
    p.add_argument("--warmup", type=int, help="untimed repetitions first (default 5; --tiny 1)")
    p.add_argument("--new-context", type=int, default=7, help="context positions each draft call brings (about tau)")
    p.add_argument("--out", type=Path, help="write the JSON result here")
    args = p.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("gpu_scale: no CUDA device; use --tiny to run the same code on CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    context, iters, warmup = args.context or (64 if args.tiny else 512), args.iters or (3 if args.tiny else 30), \
        args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    target_model, draft_model = build(TINY if args.tiny else QWEN3_8B, 5, 16, device, dtype)
    target = TargetModel(target_model, draft_model.config.target_layer_ids)
    plain = TargetModel(target_model)
    drafter = LocalDrafter(draft_model, target.embed_tokens, target.lm_head)
    clock = Clock(device)
    features = draft_model.config.hidden_size * len(draft_model.config.target_layer_ids)
    costs = measure_verify(target, plain, context, clock, iters, warmup)
    costs |= measure_draft(drafter, context, features, args.new_context, clock, iters, warmup)
    costs |= measure_rounds(SpeculativeEngine(target, drafter), SpeculativeEngine(plain), context, clock, iters, warmup)
    result = {"shape": "tiny" if args.tiny else "Qwen3-8B", "drafter_layers": 5, "dtype": str(dtype).split(".")[-1],
              "context": context, "new_context_per_draft": args.new_context,
              "machine": {"device": torch.cuda.get_device_name(0) if device.type == "cuda"
                          else platform.processor() or "CPU",
                          "torch": torch.__version__, "platform": platform.platform(),
                          "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
              "command": " ".join(["python benchmarks/gpu_scale.py", *(argv if argv is not None else sys.argv[1:])]),
              "costs_ms": costs, **implied(costs)}
    print(markdown(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
