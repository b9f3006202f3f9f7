"""The tests' verifiers (v1) environment: two in-memory copy tasks, a rubric of two rule
rewards (weights 1 and 0.5), a ``@vf.stop`` on the reply "stop", and an environment that
answers each reply (``turns > 1``) through ``agent.interaction`` (tests.support.vf_env).

verifiers imports a taskset by a top-level module name (its ``id``). Written to a folder as
its own module (``write_vf_env``) this module's name is top-level already; imported as
``tests.support.vf_copy_task`` (a run's generators can import that, as any package on their
path) it also registers itself under its last name part, so the taskset's id resolves.
"""

import sys

import verifiers.v1 as vf

WORDS = ("abc", "bad")


class CopyData(vf.TaskData):
    answer: str


class CopyTask(vf.Task[CopyData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact(self, task: CopyData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def first_char(self, task: CopyData, trace: vf.Trace) -> float:
        if FAIL:
            raise RuntimeError("the rubric broke")
        return float(trace.last_reply[:1] == task.answer[:1])

    @vf.stop
    async def said_stop(self, trace: vf.Trace) -> bool:
        return trace.last_reply == "stop"


class CopyTaskset(vf.Taskset[CopyTask, vf.TasksetConfig]):
    def load(self):
        for word in WORDS:
            yield CopyTask(CopyData(prompt=word + "=", answer=word, system_prompt=SYSTEM or None))


SYSTEM = ""
FAIL = False


class EchoConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    turns: int = 2


class EchoEnv(vf.Env[EchoConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.turns - 1):
                if segment.terminated:
                    break
                segment = await chat.turn(f"{len(segment.last_reply)}>")


class TwoSolversConfig(vf.EnvConfig):
    first: vf.AgentConfig = vf.AgentConfig()
    second: vf.AgentConfig = vf.AgentConfig()


class TwoSolvers(vf.Env[TwoSolversConfig]):
    async def run(self, task, agents):
        await agents.first.run(task)
        await agents.second.run(task)


__all__ = ["CopyTaskset"]


def _taskset_id() -> str:
    top = __name__.rpartition(".")[2]
    sys.modules.setdefault(top, sys.modules[__name__])
    return top


def load_environment(turns: int = 1, system: str = "", two: bool = False, fail: bool = False, max_turns=None):
    global SYSTEM, FAIL
    SYSTEM, FAIL = system, fail
    taskset = {"id": _taskset_id()}
    if two:
        return TwoSolvers(TwoSolversConfig(taskset=taskset))
    if turns == 1:
        return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=taskset))
    return EchoEnv(EchoConfig(taskset=taskset, turns=turns, agent={"max_turns": max_turns}))
