"""A tiny verifiers environment, written the way verifiers' own environments are: a taskset
(the dataset), a task whose ``@vf.reward`` methods are the rubric, and ``load_environment``.

    rollout:
      env: {type: verifiers, id: tiny_copy, args: {turns: 2}}   # PYTHONPATH=examples/verifiers

``turns: 1`` is single-turn (verifiers' plain ``SingleAgentEnv``: one reply, scored). With
``turns > 1`` the environment answers each reply (``CopyBackEnv``: it says which characters
were right and asks again), a multi-turn exchange driven through ``agent.interaction``.
The task is the tiny model's copy task: repeat the letters before "=".
"""

from __future__ import annotations

import verifiers.v1 as vf

WORDS = ("abc", "cab", "bad", "dead", "bead", "ace", "cede", "dab")


class CopyData(vf.TaskData):
    answer: str


class CopyTask(vf.Task[CopyData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def matched(self, task: CopyData, trace: vf.Trace) -> float:
        """Positional credit of the last reply against the answer (the rubric's rule reward)."""
        reply, answer = trace.last_reply, task.answer
        return sum(r == a for r, a in zip(reply, answer, strict=False)) / len(answer)

    @vf.reward(weight=0.1)
    async def length(self, task: CopyData, trace: vf.Trace) -> float:
        return -abs(len(trace.last_reply) - len(task.answer)) / len(task.answer)


class CopyTaskset(vf.Taskset[CopyTask, vf.TasksetConfig]):
    def load(self):
        for i, word in enumerate(WORDS):
            yield CopyTask(CopyData(id=f"copy-{i}", prompt=f"{word}=", answer=word))


class CopyBackConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    turns: int = 2


class CopyBackEnv(vf.Env[CopyBackConfig]):
    """The environment replies to every answer: which positions were right, and "again"."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()  # the task's prompt opens the exchange
            for _ in range(self.config.turns - 1):
                if segment.terminated:
                    break
                reply, answer = segment.last_reply, task.data.answer
                marks = "".join("+" if r == a else "-" for r, a in zip(reply, answer, strict=False))
                segment = await chat.turn(f"{marks}=")


__all__ = ["CopyTaskset"]


def load_environment(turns: int = 1) -> vf.Env:
    taskset = {"id": __name__}
    if turns == 1:
        return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=taskset))
    return CopyBackEnv(CopyBackConfig(taskset=taskset, turns=turns))
