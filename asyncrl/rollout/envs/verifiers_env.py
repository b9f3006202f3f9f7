"""Environments from the ``verifiers`` library as asyncrl rollouts.

    rollout:
      env: {type: verifiers, id: my_env, args: {turns: 2}}    # = env: verifiers, env_kwargs: {id, args}

``id`` names an installed module exposing ``load_environment(**args)`` (verifiers' convention)
that returns a ``verifiers.v1.Env``. Its taskset is the dataset (each task's prompt and system
prompt make a prompt; tasks are drawn in a shuffled order, epoch after epoch), its tasks'
``@vf.reward`` methods are the reward (``trace.reward``: their weighted sum, after
``Env.finalize``), and its ``run()`` drives the episode: single-turn (``agent.run``) or
multi-turn (``agent.interaction`` with the environment's replies). The agents are played by
asyncrl's engine in process (``verifiers_agents.py``), so the samples are built exactly as the
native multi-turn environments' are. Sampling (temperature, top_p, max_tokens per turn) is
asyncrl's ``rollout`` config; an agent's own ``sampling`` is not used.
"""

from __future__ import annotations

import importlib
import logging
import random
from typing import Any

from asyncrl.rollout.envs.multiturn import MultiTurnEnvironment, Policy
from asyncrl.rollout.envs.verifiers_agents import EpisodeTrajectory, play_episode, wire
from asyncrl.rollout.prompts import MESSAGES_KEY

log = logging.getLogger(__name__)

TASK_KEY = "vf_task"
"""Prompt metadata: the task's position in the taskset (the same list in every generator)."""


class VerifiersEnv(MultiTurnEnvironment):
    """A verifiers environment loaded by module name; see the module doc."""

    drives_episodes = True
    """The environment runs its own episode loop (``run_episode``), not reset/step."""

    def __init__(self, id: str, args: dict[str, Any] | None = None):
        self.id, self.args = id, dict(args or {})
        self.env = _load(id, self.args)
        self.tasks = _tasks(id, self.env)
        self._order: list[int] = []

    def make_prompt(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        if not self._order:  # a new epoch: every task once, in a fresh order
            self._order = list(range(len(self.tasks)))
            rng.shuffle(self._order)
        i = self._order.pop()
        data = self.tasks[i].data
        metadata: dict[str, Any] = {TASK_KEY: i}
        if data.system_prompt or not isinstance(data.prompt, (str, type(None))):
            # A system prompt or a message list: the chat template renders it (rollout.chat_template).
            metadata[MESSAGES_KEY] = _opening(data)
        return data.prompt_text, metadata

    def reset(self, prompt: str, metadata: dict[str, Any]) -> str:
        raise TypeError(f"verifiers environment {self.id!r} runs its own episodes (run_episode), not reset/step")

    async def run_episode(
        self, prompt: str, metadata: dict[str, Any], policy: Policy, codec, max_context_tokens: int
    ) -> EpisodeTrajectory:
        """One episode of the prompt's task, its agents played by ``policy`` (the engine)."""
        i = metadata.get(TASK_KEY)
        if not isinstance(i, int) or not 0 <= i < len(self.tasks):
            raise ValueError(
                f"verifiers environment {self.id!r}: prompt {prompt!r} names no task of its taskset "
                f"(metadata {TASK_KEY}={i!r}); its prompts come from the taskset, not rollout.prompts"
            )
        return await play_episode(self.env, self.tasks[i], policy, codec, max_context_tokens)


def _opening(data) -> list[dict[str, str]]:
    import verifiers.v1 as vf  # type: ignore[import-untyped]  # heavy (openai, mcp): only once an environment is built

    system = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    prompt = [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt or [])
    return wire([*system, *prompt])


def _load(id: str, args: dict[str, Any]):
    where = f"verifiers environment {id!r}"
    try:
        import verifiers.v1 as vf  # heavy: see _opening
    except ImportError as e:
        raise ValueError(
            f"{where}: the verifiers package is not installed (pip install 'asyncrl[verifiers]'): {e}"
        ) from e
    try:
        module = importlib.import_module(id)
    except Exception as e:  # user code: whatever its import raises is this id's failure
        raise ValueError(f"{where}: cannot import module {id!r}: {type(e).__name__}: {e}") from e
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise ValueError(f"{where}: module {id!r} has no load_environment(**args) function")
    try:
        env = load(**args)
    except TypeError as e:
        raise ValueError(f"{where}: bad args {args!r} for load_environment: {e}") from e
    except Exception as e:  # user code, as above
        raise ValueError(f"{where}: load_environment(**{args!r}) raised {type(e).__name__}: {e}") from e
    if not isinstance(env, vf.Env):
        raise ValueError(f"{where}: load_environment returned a {type(env).__name__}, expected a verifiers.v1.Env")
    return env


def _tasks(id: str, env) -> list:
    where = f"verifiers environment {id!r}"
    taskset = env.taskset
    if not taskset.bounded:
        raise ValueError(f"{where}: its taskset is infinite; bound it (taskset.take(n)) in load_environment")
    tasks = list(taskset)
    if not tasks:
        raise ValueError(f"{where}: its taskset has no tasks")
    task_cls = type(tasks[0])
    if task_cls.toolsets(tasks[0].config) or type(taskset).toolsets(taskset.config):
        raise ValueError(f"{where}: tool servers (toolsets) are not supported")
    if tasks[0].config.judges:
        raise ValueError(f"{where}: judges call a model endpoint of their own; they are not supported")
    for t in tasks:
        if t.data.prompt is not None and not isinstance(t.data.prompt, str):
            wire(t.data.prompt)  # text messages only: fails here, not in a generator
    return tasks
