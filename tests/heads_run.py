"""One generation with a target's draft heads attached (MTP heads, Gemma 4's assistant or an
EAGLE-3 head), shared by the heads' tests."""

from __future__ import annotations

from specrun.backend import Model
from specrun.costs import CostModel
from specrun.engine import Engine, Settings
from specrun.sampling import Sampler

# every head's exactness runs: 64 tokens of each of three prompts (prose, code, Japanese)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The",
    "def fibonacci(n: int) -> int:\n    if n < 2:",
    "今日はとても良い天気です。私は",
]
N_TOKENS = 64


def run(target: Model, settings: Settings, prompt: list[int], n: int, sampler: Sampler | None = None, on_step=None, cost=None):
    """One generation from a clean cache, with whatever heads ``target`` has attached; the
    tokens and the run's stats. ``on_step(engine, step)`` sees every round."""
    target.reset()
    e = Engine(target, None, settings, sampler or Sampler(0.0), cost or CostModel(), heads=target.heads, eagle3=target.eagle3)
    out, stats = [], None
    for step in e.generate(prompt, n):
        out += step.tokens
        stats = step.stats
        if on_step is not None:
            on_step(e, step)
    return out, stats
