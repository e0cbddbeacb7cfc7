"""`dflash bench`: DFlash beside what a user would pick instead, measured in one run on the same prompts.

Three modes: the comparison (default; ends with a profile of one round), `--profile` (the profile
alone) and `--load 1,2,4,...` (a sweep over concurrent streaming clients of a running service, DFlash
beside target only at each concurrency, and beside any OpenAI-compatible server given with --openai:
vLLM, or our own HTTP API, on the same prompts with the same load).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..defaults import DEMO_AR_DRAFT
from ..errors import DFlashError
from .generate import add_model_args, model_dirs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..engine import SpeculativeEngine

METHODS = ("target", "hf", "assisted", "lookup", "dflash16", "dflash16c", "dflash8", "hfdflash", "service")
REFERENCE = "target only (engine, block 1)"
DEFAULT_DRAFT_CONFIDENCE = 0.05


@dataclass(frozen=True)
class BenchArgs:
    """The run's settings, resolved once from the command line (`--quick` applied)."""

    num_prompts: int
    max_new_tokens: int
    temperatures: tuple[float, ...]
    methods: tuple[str, ...]
    profile_rounds: int
    duration_s: float | None  # load mode: a cap per cell; None runs every request


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark DFlash against other decoders (same run, same prompts)",
                       description="Decode the same prompts with every method, interleaved; print a Markdown table "
                                   "and write JSON, results.md and PNG plots. With no --target: the demo pair.")
    add_model_args(p)
    p.add_argument("--ar-draft", help="autoregressive draft model for transformers assisted generation "
                                      "(default with the demo pair: its same-budget AR draft)")
    p.add_argument("--prompts", type=Path,
                   help="JSONL file, one {\"prompt\": ...} per line (default: held-out stdlib prompts)")
    p.add_argument("--num-prompts", type=int, help="prompts to use (default 24; --quick 4)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default 128; --quick 64)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated (default 0,1); 0 is greedy")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--service", metavar="HOST:PORT", help="a running `dflash serve` for the service method and --load")
    p.add_argument("--service-token", default="", help="bearer token for a service with auth on")
    p.add_argument("--assist-tokens", type=int,
                   help="draft tokens per assisted round (default: transformers' own schedule)")
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt-lookup tokens per round (default 10)")
    p.add_argument("--draft-confidence", type=float, default=DEFAULT_DRAFT_CONFIDENCE,
                   help=f"the dflash16c method's draft confidence threshold (default {DEFAULT_DRAFT_CONFIDENCE:g})")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory (default bench-results)")
    p.add_argument("--quick", action="store_true", help="a few prompts and tokens: a few minutes on a laptop CPU")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="which held-out prompts (default 0)")
    p.add_argument("--no-profile", action="store_true", help="skip the profile of one round")
    p.add_argument("--profile", action="store_true", help="only profile one DFlash round and print the breakdown")
    p.add_argument("--load", metavar="N[,N...]",
                   help="load mode: a sweep over these concurrencies (e.g. 1,2,4,8,16) against --service; at each, "
                        "the service's default block (dflash) and block 1 (target-only), writes load.json, load.png")
    p.add_argument("--openai", metavar="[NAME=]URL", action="append", default=[],
                   help="load mode: also measure this OpenAI-compatible server (its base URL, e.g. "
                        "http://127.0.0.1:8000/v1; vLLM, SGLang or `dflash serve`'s own) with the same prompts and "
                        "load; NAME labels its column (default: its host:port); repeatable, --service optional")
    p.add_argument("--openai-token", default="", help="API key for the --openai servers (default: --service-token)")
    p.add_argument("--in-process", action="store_true",
                   help="load mode: also run dflash and target-only through an engine in this process (the loop "
                        "on, a thread per stream), in the same sweep: what the serving path keeps of the engine")
    p.add_argument("--requests-per-stream", type=int, default=2, metavar="N",
                   help="load mode: requests each concurrent stream sends, one after another (default 2)")
    p.add_argument("--passes", type=int, default=1, metavar="N",
                   help="load mode: run the whole sweep N times, the methods' order alternating; each cell is "
                        "then its median pass and each ratio the median of the passes' own (default 1)")
    p.add_argument("--duration", type=float, metavar="S",
                   help="load mode: optional cap in seconds per cell (default none: every request runs to the end)")
    p.set_defaults(handler=run)


def resolve(args: argparse.Namespace) -> BenchArgs:
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise DFlashError(f"--methods: unknown {sorted(unknown)}; choose from {','.join(METHODS)}")
    try:
        temperatures = tuple(float(t) for t in args.temperatures.split(","))
    except ValueError:
        raise DFlashError(f"--temperatures: expected numbers like 0,1, got {args.temperatures!r}") from None
    if any(t < 0 for t in temperatures):
        raise DFlashError(f"--temperatures must be >= 0, got {args.temperatures!r}")
    if args.openai and not args.load:
        raise DFlashError("--openai: measured in load mode; add --load 1,2,4 (the concurrencies)")
    if not 0.0 < args.draft_confidence < 1.0:  # 0 would make dflash16c the dflash16 method again
        raise DFlashError(f"--draft-confidence must be in (0, 1), got {args.draft_confidence}")
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--requests-per-stream", args.requests_per_stream), ("--duration", args.duration)):
        if value is not None and value <= 0:
            raise DFlashError(f"{flag} must be positive, got {value}")
    return BenchArgs(
        num_prompts=args.num_prompts or (4 if args.quick else 24),
        max_new_tokens=args.max_new_tokens or (64 if args.quick else 128),
        temperatures=temperatures,
        methods=methods,
        profile_rounds=12 if args.quick else 32,
        duration_s=args.duration,
    )


def run(args: argparse.Namespace) -> int:
    settings = resolve(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.load:
        return run_load_mode(args, settings)
    return run_compare(args, settings)


def read_prompts(args: argparse.Namespace, n: int) -> list[str]:
    if args.prompts is None:
        from ..demo.corpus import heldout_prompts

        return heldout_prompts(n, seed=args.seed)
    try:
        records = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise DFlashError(f"--prompts {args.prompts}: {exc}") from None
    prompts = [r.get("prompt", r.get("text")) if isinstance(r, dict) else r for r in records]
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise DFlashError(f"--prompts {args.prompts}: every line must be a JSON object with a non-empty \"prompt\"")
    return prompts[:n]


def run_compare(args: argparse.Namespace, settings: BenchArgs) -> int:
    from transformers.utils import logging as hf_logging

    from ..bench.methods import build_methods
    from ..bench.report import machine, markdown_table, summarize, write_outputs
    from ..bench.runner import BenchSettings, run_bench

    hf_logging.set_verbosity_error()  # transformers' deprecation chatter would break up the progress bar
    target, drafter = model_dirs(args)
    ar_draft = args.ar_draft or (DEMO_AR_DRAFT if args.target is None else None)
    engine, baseline, ar_model = load_models(target, drafter, ar_draft, args)
    prompts = [engine.encode(p) for p in read_prompts(args, settings.num_prompts)]
    if args.profile:
        print(profile_text(engine, baseline, prompts[0], settings, None))
        if "dflash16c" in settings.methods:
            print("\n" + profile_text(engine, baseline, prompts[0], settings, None, args.draft_confidence))
        return 0
    methods, unavailable = build_methods(settings.methods, engine, baseline, ar_model, args.service,
                                         args.assist_tokens, args.lookup_tokens, args.service_token,
                                         args.draft_confidence)
    bench = run_bench(methods, prompts, BenchSettings(settings.max_new_tokens, settings.temperatures))
    rows = summarize(bench, REFERENCE, unavailable)
    print(markdown_table(rows))
    profile = None
    if not args.no_profile and engine.drafter is not None:
        profile = profile_text(engine, baseline, prompts[0], settings, _tau(rows, engine.drafter.block_size))
        if "dflash16c" in settings.methods and engine.drafter.block_size >= 16:
            profile += "\n\n" + profile_text(engine, baseline, prompts[0], settings,
                                              _tau(rows, 16, args.draft_confidence), args.draft_confidence)
        print("\n" + profile)
    meta = {"command": command_line(args), "machine": machine(), "settings": settings.__dict__,
            "models": {"target": str(target), "drafter": str(drafter), "ar_draft": str(ar_draft)},
            "prompts": len(prompts), "profile": profile}
    paths = write_outputs(args.out, rows, meta, profile)
    print("\nwrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def command_line(args: argparse.Namespace) -> str:
    """The `dflash bench ...` command that reproduces this run (options that differ from the defaults)."""
    from ..cli import build_parser

    defaults = vars(build_parser().parse_args(["bench"]))
    words = ["dflash", "bench"]
    for key, value in vars(args).items():
        if key in ("handler", "command") or value == defaults.get(key):
            continue
        for one in value if isinstance(value, list) else [value]:
            words.append("--" + key.replace("_", "-"))
            if one is not True:
                words.append("<token>" if key in ("service_token", "openai_token") else str(one))
    return shlex.join(words)


def load_models(target: str | Path, drafter: str | Path | None, ar_draft: str | Path | None,
                args: argparse.Namespace) -> tuple[SpeculativeEngine, SpeculativeEngine, PreTrainedModel | str]:
    """The DFlash engine, a target-only engine sharing its model, and the AR draft model (or a reason)."""
    from ..engine import SpeculativeEngine
    from ..loading import build_engine, load_target, prepare_for_inference, resolve_device
    from ..scheduler import SchedulerConfig
    from ..target import TargetModel

    # One stream per method, every proposal verified: the method as the paper runs it. The adaptive
    # verify policy is a batching concern, measured by --load through the service.
    engine = build_engine(target, drafter, device=args.device, dtype=args.dtype, drafter_dtype=args.drafter_dtype,
                          scheduler=SchedulerConfig(verify_policy="full"))
    if engine.tokenizer is None:
        raise DFlashError(f"the target '{target}' has no tokenizer; dflash bench needs one to encode prompts")
    model = engine.target.model
    baseline = SpeculativeEngine(TargetModel(model), None, engine.tokenizer, engine.eos_token_ids)
    if ar_draft is None:
        ar_model = "no autoregressive draft model given (--ar-draft DIR)"
    elif ar_draft == DEMO_AR_DRAFT and not (ar_draft / "config.json").is_file():
        ar_model = f"the demo's autoregressive draft model is missing ({ar_draft}); rebuild with `dflash demo build`"
    else:
        ar_model, _ = load_target(ar_draft, resolve_device(args.device), model.dtype)
        prepare_for_inference(ar_model)  # as the engine's target and drafter are laid out
    return engine, baseline, ar_model


def _tau(rows: list[dict], block_size: int, draft_confidence: float = 0.0) -> float | None:
    name = f"DFlash block {block_size}" + (f", draft confidence {draft_confidence:g}" if draft_confidence else "")
    for r in rows:
        if r["method"] == name and r["temperature"] == 0.0 and "unavailable" not in r:
            return r["tau"]
    return None


def profile_text(engine: SpeculativeEngine, baseline: SpeculativeEngine, prompt_ids: list[int], settings: BenchArgs,
                 tau: float | None, draft_confidence: float = 0.0) -> str:
    from ..bench.profile_round import format_profile, profile_round

    if engine.drafter is None:
        raise DFlashError("--profile needs a drafter")
    p = profile_round(engine, prompt_ids, engine.drafter.block_size, settings.profile_rounds, baseline=baseline,
                      draft_confidence=draft_confidence)
    return format_profile(p, tau)


def run_load_mode(args: argparse.Namespace, settings: BenchArgs) -> int:
    from ..bench.load import METHODS, SweepSettings, parse_concurrencies, run_sweep
    from ..bench.load_report import format_sweep, machine, write_outputs

    concurrencies = parse_concurrencies(args.load)
    if not args.service and not args.openai and not args.in_process:
        raise DFlashError("--load needs --service HOST:PORT of a running `dflash serve`, --openai URL or --in-process")
    methods = (METHODS if args.service else ()) + openai_methods(args.openai)
    in_process = None
    if args.in_process:
        in_process, extra = in_process_methods(args)
        methods += extra
    sweep = SweepSettings(args.service or "", concurrencies, args.requests_per_stream, settings.max_new_tokens,
                          settings.temperatures[0], duration_s=settings.duration_s, methods=methods,
                          token=args.service_token, openai_token=args.openai_token or args.service_token,
                          in_process=in_process, passes=args.passes)
    prompts = read_prompts(args, settings.num_prompts)
    result = run_sweep(sweep, prompts, progress=_print_cell)
    print(format_sweep(result))
    meta = {"command": command_line(args), "machine": machine(), "prompts": len(prompts)}
    paths = write_outputs(args.out, result, meta)
    print("\nwrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def in_process_methods(args: argparse.Namespace) -> tuple:
    """--in-process: the service's two methods again, through an engine in this process built as the
    verifier builds its own (the service's scheduler defaults), one torch thread unless --threads."""
    import torch

    from ..bench.inprocess_client import InProcessClient
    from ..bench.load import METHODS, LoadMethod
    from ..loading import build_engine

    if not args.threads:
        torch.set_num_threads(1)  # what Ray gives a verifier replica
    target, drafter = model_dirs(args)
    client = InProcessClient(build_engine(target, drafter, device=args.device, dtype=args.dtype,
                                                drafter_dtype=args.drafter_dtype))
    return client, tuple(LoadMethod(f"in-process {m.name}", m.block_size, in_process=True) for m in METHODS)


def openai_methods(values: list[str]) -> tuple:
    """A load method per `--openai [NAME=]URL`; DFlashError for a URL that is not http(s) or a repeated name."""
    from urllib.parse import urlparse

    from ..bench.load import LoadMethod

    methods = []
    for value in values:
        name, sep, url = value.partition("=") if "=" in value.split("://")[0] else ("", "", value)
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise DFlashError(f"--openai: expected [NAME=]http://HOST:PORT/v1, got {value!r}")
        methods.append(LoadMethod(name or parsed.netloc, None, openai_url=url.rstrip("/")))
    names = [m.name for m in methods]
    if len(set(names)) < len(names) or {"dflash", "target-only"} & set(names):
        raise DFlashError(f"--openai: each server needs its own NAME (not dflash or target-only), got {names}")
    return tuple(methods)


def _print_cell(cell: dict) -> None:
    print(f"c={cell['concurrency']} {cell['method']}: {cell['tokens_per_s']:.1f} tok/s, {cell['requests']} requests, "
          f"{cell['errors']} errors, {cell['wall_s']:.2f} s", file=sys.stderr, flush=True)
