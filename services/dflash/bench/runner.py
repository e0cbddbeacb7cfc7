"""Interleaved runs: every prompt goes through every method before the next prompt starts.

The method order rotates from prompt to prompt, so machine drift (thermal, background load, cache
warmth) hits every method alike instead of whichever ran last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from .methods import Method, Sample

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0)
    warmup: bool = True


@dataclass
class BenchRun:
    """Samples per (method name, temperature), one per prompt in prompt order; errors by method."""

    settings: BenchSettings
    methods: list[str]
    num_prompts: int
    samples: dict[tuple[str, float], list[Sample]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def run_bench(methods: list[Method], prompts: list[list[int]], settings: BenchSettings,
              progress: bool = True) -> BenchRun:
    """Decode every prompt with every method at every temperature; a method that raises is dropped
    from the rest of the run and its error recorded."""
    run = BenchRun(settings, [m.name for m in methods], len(prompts))
    live = list(methods)
    if settings.warmup and prompts:
        for m in list(live):
            _try(run, live, m, prompts[0], min(WARMUP_TOKENS, settings.max_new_tokens), 0.0, 0)
    total = len(prompts) * len(settings.temperatures) * len(methods)
    with tqdm(total=total, desc="bench", unit="run", disable=not progress, dynamic_ncols=True) as bar:
        for i, prompt in enumerate(prompts):
            for j, temperature in enumerate(settings.temperatures):
                shift = (i * len(settings.temperatures) + j) % max(len(methods), 1)
                for m in methods[shift:] + methods[:shift]:
                    bar.set_postfix_str(f"{m.name}, T={temperature:g}", refresh=False)
                    if m in live:
                        sample = _try(run, live, m, prompt, settings.max_new_tokens, temperature, seed=i)
                        if sample is not None:
                            run.samples.setdefault((m.name, temperature), []).append(sample)
                    bar.update(1)
    return run


def _try(run: BenchRun, live: list[Method], method: Method, prompt: list[int], max_new_tokens: int,
         temperature: float, seed: int) -> Sample | None:
    try:
        return method.run(prompt, max_new_tokens, temperature, seed)
    except Exception as exc:  # a broken method must not take the others down; its row says why
        run.errors[method.name] = f"{type(exc).__name__}: {exc}"
        live.remove(method)
        return None
