"""Plain reward functions in place of an environment's reward, as TRL users write them.

    rollout:
      env: copy                                  # still makes (or reads) the prompts
      rewards:
        - {fn: my_pkg.rewards:exact_match, weight: 1.0}
        - {fn: my_pkg.rewards:short_answer, weight: 0.2}

    def exact_match(prompts, completions, **columns) -> list[float]:   # TRL's signature
        return [1.0 if c.strip() == t else 0.0 for c, t in zip(completions, columns["target"])]

Each function gets one sample at a time as lists of length 1: ``prompts=[prompt]``,
``completions=[response]`` and every metadata field of the prompt (the dataset's other
columns, e.g. ``answer``) as ``name=[value]``. The sample's reward is sum_i weight_i *
fn_i(...)[0]; a function may return None for "does not apply" (TRL's convention), which adds
nothing. A function that raises or returns a non-number fails that sample only (see
``score``), as an environment's reward would.

A function may be ``async def`` (a remote verifier) and may set its own ``timeout_s``:
generators call each function separately, off their event loop and under its timeout
(asyncrl.rollout.scoring).

An entry ``{model: DIR, weight: w, ...}`` is a reward model: the same call, answered by the
run's actor for that entry (asyncrl.rollout.reward_model), so it sums with the functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.config.reward_model import RewardModelConfig
from asyncrl.rollout.envs.base import (
    Environment,
    check_env_kwargs,
    did_you_mean,
    import_user_module,
    make_env,
    run_if_coroutine,
)
from asyncrl.rollout.reward_model import RewardModelClient


def resolve_function(path: str) -> Callable:
    """'package.module:function' -> the callable (ValueError saying what is wrong)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {path!r}: not an import path 'package.module:function'")
    module = import_user_module(f"reward function {path!r}", module_name)
    try:
        fn = getattr(module, attr)
    except AttributeError:
        hint = did_you_mean(attr, [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")])
        raise ValueError(f"reward function {path!r}: module {module_name!r} has no attribute {attr!r}{hint}") from None
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is a {type(fn).__name__}, not a function")
    return fn


@dataclass(frozen=True)
class RewardFn:
    """One function of rollout.rewards, resolved."""

    path: str
    fn: Callable
    weight: float
    timeout_s: float | None
    """Its own rollout.rewards[i].timeout_s; None: rollout.reward_timeout_s."""


class WeightedRewards(Environment):
    """An environment's prompts with the weighted sum of reward functions as its reward.

    Generators call each function separately, off their loop and under its timeout
    (asyncrl.rollout.scoring); ``reward`` calls them in turn, for scoring outside a generator."""

    def __init__(self, base: Environment, specs: Sequence[Any], run: str | None = None):
        if base.multi_turn:
            raise ValueError(
                f"rollout.rewards replaces a single-turn reward; {type(base).__name__} is multi-turn "
                f"(its rewards come from step())"
            )
        self.base = base
        self.fns = [self._resolve(i, spec, run) for i, spec in enumerate(specs)]

    @staticmethod
    def _resolve(index: int, spec: Any, run: str | None) -> RewardFn:
        """A function by its import path, or a reward model's client (``run`` names its actor)."""
        if isinstance(spec, RewardModelConfig):
            client = RewardModelClient(run, index)
            return RewardFn(f"{client.where}.model", client.score, float(spec.weight), spec.timeout_s)
        try:
            fn = resolve_function(spec.fn)
        except ValueError as e:
            raise ValueError(f"rollout.rewards[{index}].fn: {e}") from e
        return RewardFn(spec.fn, fn, float(spec.weight), getattr(spec, "timeout_s", None))

    def make_prompt(self, rng):
        return self.base.make_prompt(rng)

    @staticmethod
    def call_kwargs(prompt: str, response: str, metadata: dict[str, Any]) -> dict[str, Any]:
        """TRL's keyword arguments for one sample: every field a list of length 1."""
        return {"prompts": [prompt], "completions": [response], **{k: [v] for k, v in metadata.items()}}

    def combine(self, outs: Sequence[Any]) -> float:
        """The weighted sum of the functions' outputs (in ``fns`` order); None adds nothing."""
        total = 0.0
        for f, out in zip(self.fns, outs, strict=True):
            value = out[0] if isinstance(out, (list, tuple)) else out
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{f.path} returned {value!r}, expected a finite number (or None)")
            total += f.weight * float(value)
        return total

    def reward(self, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        kwargs = self.call_kwargs(prompt, response, metadata)
        return self.combine([run_if_coroutine(f.fn(**kwargs)) for f in self.fns])


def make_rollout_env(rollout, run: str | None = None) -> Environment:
    """The environment a rollout config describes: ``rollout.env`` with its kwargs, its reward
    replaced by ``rollout.rewards`` when those are given (generators and evaluation alike).
    ``run``: the run whose reward-model actors score its reward models (None: not scored here)."""
    env = make_env(rollout.env, rollout.env_kwargs)
    return WeightedRewards(env, rollout.rewards, run) if rollout.rewards else env


def check_rollout_code(rollout) -> None:
    """What a generator would die of when it builds its environment, checked before a run starts
    anything: the environment's class takes rollout.env_kwargs, and every reward function is
    imported (ValueError naming the field). Nothing is built here (a library environment may
    load a dataset when it is)."""
    check_env_kwargs(rollout.env, rollout.env_kwargs)
    for i, spec in enumerate(rollout.rewards):
        if not isinstance(spec, RewardModelConfig):
            WeightedRewards._resolve(i, spec, None)


def task_target_length(rollout) -> float | None:
    """Mean characters of a correct response for this rollout config, when the environment
    makes its own prompts and scores them itself (a prompt file or reward functions may ask for
    something else); None when unknown."""
    if rollout.prompts or rollout.rewards:
        return None
    return make_env(rollout.env, rollout.env_kwargs).target_length()
