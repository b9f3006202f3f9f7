"""The environment contract and the registry that finds one by name or import path.

    env = make_env("copy", {"min_len": 3})            # a built-in (asyncrl.config.ENVIRONMENTS)
    env = make_env("my_pkg.tasks:MyEnv", {"k": 1})    # or any class on the Python path
    prompt, metadata = env.make_prompt(random.Random(0))
    reward = env.reward(prompt, response, metadata)

Single-turn environments score one response. Multi-turn ones (``MultiTurnEnvironment`` in
``multiturn.py``) are stepped: ``reset`` gives the first observation, ``step(response)``
returns ``(observation, reward, done)``. Import paths (not pickled objects) name user
environments so that every Ray worker can build its own copy.
"""

from __future__ import annotations

import asyncio
import difflib
import importlib
import inspect
import math
import random
from types import ModuleType
from typing import Any

from asyncrl.config.base import not_on_path
from asyncrl.data.tokens import sampleable_ids
from asyncrl.types import MAX_ABS_REWARD

BUILTIN = {
    "copy": "asyncrl.rollout.envs.synthetic:CopyEnv",
    "reverse": "asyncrl.rollout.envs.synthetic:ReverseEnv",
    "arithmetic": "asyncrl.rollout.envs.synthetic:ArithmeticEnv",
    "gsm8k": "asyncrl.rollout.envs.gsm8k:GSM8KEnv",
    "math": "asyncrl.rollout.envs.math_env:MathEnv",
    "countdown_chat": "asyncrl.rollout.envs.multiturn:CountdownChatEnv",
    "tools": "asyncrl.rollout.envs.tools:ToolEnv",
    "verifiers": "asyncrl.rollout.envs.verifiers_env:VerifiersEnv",
    "code": "asyncrl.rollout.envs.code:CodeEnv",
}


class Environment:
    """A single-turn task: makes prompts (optional) and scores responses.

    Subclasses override ``reward`` and, when the task makes its own prompts, ``make_prompt``.
    ``metadata`` must be msgpack-able: it travels with the rollout group through Redis.

    Optional: ``reward_with_counts(prompt, response, metadata) -> (reward, {name: int})``, a
    plain ``def`` that generators call in place of ``reward`` to also get counts of what the
    scoring did (the code env's test runs and timeouts); they are summed per step into
    ``rollout/<name>`` for the names the metric catalogue knows.
    """

    multi_turn = False
    sample_special_tokens = True
    """False: generators never sample a special token other than EOS for this task. The reward
    sees text decoded with the special tokens stripped, so sampling them would be free padding
    (a policy learns to fill its answer with <pad>/<bos> instead of learning to stop)."""

    def target_length(self) -> float | None:
        """Mean length in characters of a correct response (before EOS), when the task knows it:
        the run summary and the console show it next to the mean response length."""
        return None

    def make_prompt(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__} does not make prompts; set rollout.prompts to a prompt file")

    def reward(self, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        raise NotImplementedError(f"{type(self).__name__}.reward is not implemented")


class RewardError(RuntimeError):
    """The environment's reward function raised or returned something that is not a finite number."""


def score(env: Environment, prompt: str, response: str, metadata: dict[str, Any]) -> float:
    """Call ``env.reward`` and insist on a finite float; anything else becomes a RewardError.

    The generator catches RewardError and marks the sample (reward NaN, ``error`` set)
    instead of dying: a buggy reward must not stop generation.
    """
    try:
        value = run_if_coroutine(env.reward(prompt, response, metadata))
    except Exception as e:  # user code: any exception is the reward's failure, not ours
        raise RewardError(f"{type(env).__name__}.reward raised {type(e).__name__}: {e}") from e
    return check_reward_value(f"{type(env).__name__}.reward", value)


def run_if_coroutine(value: Any) -> Any:
    """An ``async def`` reward's result, for the callers that score outside an event loop
    (evaluation); the generators await it on their loop instead (asyncrl.rollout.scoring)."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def check_reward_value(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite number, else a RewardError naming ``name``."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"{name} returned {value!r}, expected a float")
    if not math.isfinite(value):
        raise RewardError(f"{name} returned {value!r}, expected a finite float")
    if abs(value) > MAX_ABS_REWARD:
        raise RewardError(f"{name} returned {value!r}, beyond the bound |reward| <= {MAX_ABS_REWARD:g}")
    return float(value)


def allowed_token_ids(env_name: str, tokenizer) -> list[int] | None:
    """The ids generators may sample for ``env_name`` (None: any). An environment with
    ``sample_special_tokens = False`` gets every token of the tokenizer but its special ones,
    EOS excepted (asyncrl.data.tokens, which the learner masks its logits with as well)."""
    if resolve_env_class(env_name).sample_special_tokens:
        return None
    return sampleable_ids(tokenizer)


def did_you_mean(name: str, candidates: list[str]) -> str:
    """'; did you mean 'x'?' for the candidate closest to a misspelled name, else ''."""
    close = difflib.get_close_matches(name, candidates, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def import_user_module(what: str, module_name: str) -> ModuleType:
    """Import the module of a user's import path; ValueError naming ``what`` when it fails
    (a module not on the path says how to put it there)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (
            module_name == e.name or module_name.startswith(f"{e.name}.")
        ):  # the path's own module, not one it imports
            raise ValueError(f"{what}: module {module_name!r} {not_on_path(module_name)}") from e
        raise ValueError(f"{what}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    except Exception as e:  # user code: whatever its import raises (not only ImportError) is this path's failure
        raise ValueError(f"{what}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e


def resolve_env_class(name: str) -> type[Environment]:
    """A built-in name or 'package.module:Class' -> the class (ValueError with what is allowed)."""
    path = BUILTIN.get(name, name)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"environment {name!r}: not a built-in ({', '.join(BUILTIN)}) nor an import path 'package.module:Class'"
        )
    module = import_user_module(f"environment {name!r}", module_name)
    try:
        cls = getattr(module, attr)
    except AttributeError:
        hint = did_you_mean(attr, [n for n, v in vars(module).items() if isinstance(v, type)])
        raise ValueError(f"environment {name!r}: module {module_name!r} has no attribute {attr!r}{hint}") from None
    if not isinstance(cls, type):
        raise ValueError(f"environment {name!r}: {path} is a {type(cls).__name__}, expected a class")
    return cls


def check_env_kwargs(name: str, kwargs: dict[str, Any] | None) -> type[Environment]:
    """The environment's class, once its constructor is known to accept ``kwargs`` by name
    (ValueError naming the keys it does not take and the ones it does). Nothing is built: a
    run checks this before it starts anything."""
    cls = resolve_env_class(name)
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a constructor Python cannot introspect: building it will tell
        return cls
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return cls
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in (kwargs or {}) if k not in takes]
    if unknown:
        hints = "".join(did_you_mean(k, takes) for k in unknown[:1])
        raise ValueError(
            f"environment {name!r}: bad rollout.env_kwargs {kwargs!r}: {cls.__name__} does not take "
            f"{', '.join(map(repr, unknown))}{hints} (it takes: {', '.join(takes) or 'nothing'}); "
            "a changed rollout.env usually needs its own rollout.env_kwargs (rollout.env_kwargs={} for its defaults)"
        )
    return cls


def make_env(name: str, kwargs: dict[str, Any] | None = None) -> Environment:
    """Build an environment from its registry name (or import path) and rollout.env_kwargs."""
    cls = check_env_kwargs(name, kwargs)
    try:
        return cls(**(kwargs or {}))
    except TypeError as e:
        raise ValueError(f"environment {name!r}: bad rollout.env_kwargs {kwargs!r}: {e}") from e
