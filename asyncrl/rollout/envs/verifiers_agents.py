"""A verifiers episode played on asyncrl's engine: the agents a ``vf.Env`` drives, in process.

    traj = await play_episode(vf_env, task, policy, codec, budget)   # an EpisodeTrajectory

verifiers (v1) reaches the model from a harness program that calls an OpenAI-compatible
endpoint, the interception server, which hands each request to a ``Client``. Here the
environment's control flow (``Env.setup``/``run``/``finalize``) runs unchanged, but the
agents it is given (``vf.Agents`` built with our factory) answer ``agent.run(task)`` and
``agent.interaction(task)`` themselves, as verifiers' tool-less ``null`` chat loop would:
each model turn is one request to asyncrl's engine (``policy``), no server, no program.

The context is grown the native multi-turn way (``chat.py``): the first prompt rendered as
the prompts of single-turn environments are, each reply kept as the engine's ids, each
environment message appended as a chat turn of the codec. So the trainable agent's turns
become a ``Trajectory`` whose samples carry exactly the ids, logprobs and versions the
engine produced. Every turn is also committed to a real ``vf.Trace`` (the engine's prompt
and completion ids as its ``TurnTokens``), so the task's ``@vf.reward`` and ``@vf.metric``
methods, ``@vf.stop`` predicates and ``Env.finalize`` read the trace they expect; its
weighted reward (``trace.reward``) is the sample's return.
"""

from __future__ import annotations

import asyncio
import math
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from asyncrl.rollout.envs.chat import ChatTurns, TurnCodec
from asyncrl.rollout.envs.multiturn import Policy, Trajectory, TurnAborted
from asyncrl.rollout.prompts import MESSAGES_KEY, PromptSourceError, encode_prompt

FINISH = {"stop": "stop", "length": "length"}


@dataclass
class EpisodeTrajectory(Trajectory):
    """The trainable agent's trajectory; ``error`` says why its reward is missing (NaN)."""

    error: str | None = None


class EpisodeError(RuntimeError):
    """The episode cannot become a sample (no trainable turn, or several trainable agents)."""


def wire(messages) -> list[dict[str, str]]:
    """verifiers messages -> the {"role", "content"} dicts a chat template renders (text only)."""
    out = []
    for m in messages:
        if not isinstance(m.content, str) or getattr(m, "tool_calls", None):
            raise EpisodeError(f"a {m.role} message with tool calls or non-text content is not supported")
        out.append({"role": m.role, "content": m.content})
    return out


class Conversation:
    """One agent run: its vf trace, the engine context, and (trainable) its trajectory."""

    def __init__(self, episode: Episode, seat: Seat, task):
        import verifiers.v1 as vf  # type: ignore[import-untyped]  # heavy (openai, mcp): only where an episode is played

        self.vf, self.episode, self.seat, self.task = vf, episode, seat, task
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=seat.config, name=seat.name, trainable=seat.trainable),
        )
        self.messages: list[Any] = []
        self.context: list[int] | None = None
        self.traj: EpisodeTrajectory | None = None
        self.last: tuple[list[int], str] = ([], "stop")
        self.over = False
        self.closed = False
        self.stops = task.hooks("stop")
        episode.conversations.append(self)

    # ------------------------------------------------------------------ context
    def _open(self, first: list[Any]) -> None:
        """The first context: system prompt, then the task's prompt or the caller's first message."""
        vf, data = self.vf, self.task.data
        system = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
        if data.prompt is None:
            opening = first
        elif isinstance(data.prompt, str):
            opening = [vf.UserMessage(content=data.prompt)]
        else:
            opening = list(data.prompt)
        self.messages = [*system, *opening]
        codec, tok = self.episode.codec, self.episode.codec_tokenizer
        if len(self.messages) == 1 and self.messages[0].role == "user":
            ids = codec.prompt(wire(self.messages)[0]["content"])
        else:  # several messages: the template renders them (without one, encode_prompt says it needs one)
            ids = encode_prompt(tok, "", isinstance(codec, ChatTurns), {MESSAGES_KEY: wire(self.messages)})
        self.context = list(ids)
        if self.seat.trainable:
            self.traj = EpisodeTrajectory(prompt_ids=list(ids))

    def _extend(self, new: list[Any]) -> bool:
        """Append the caller's message as an observation; False when it does not fit."""
        assert self.context is not None
        if len(new) != 1 or new[0].role != "user":
            raise EpisodeError("an interaction turn takes one user message (text)")
        (text,) = (m["content"] for m in wire(new))
        obs = self.episode.codec.observation(text, *self.last)
        if len(self.context) + len(obs) >= self.episode.budget:
            return False
        self.context += obs
        self.messages += new
        if self.traj is not None:
            self.traj.observation_ids[-1] = list(obs)
        return True

    # ------------------------------------------------------------------ one turn
    async def turn(self, message) -> Any:
        vf = self.vf
        if self.closed:
            raise RuntimeError("this interaction is closed")
        new = self._messages(message)
        limit = self.seat.config.max_turns
        if self.over:  # a stop predicate, a limit or a full context ended it
            return vf.Segment(messages=[], terminated=True)
        if limit is not None and self.trace.num_turns >= limit:
            return self._end("max_turns")
        if self.context is None:  # verifiers' rule: a prompted task speaks first, a prompt-less one is opened
            prompted = self.task.data.prompt is not None
            if prompted == bool(new):
                raise ValueError(
                    "a prompted task's first turn() takes no message"
                    if prompted
                    else "a task without a prompt is opened by the first turn(message)"
                )
            self._open(new)
        elif not new:
            raise ValueError("this exchange takes its next user message")
        elif not self._extend(new):
            return self._end("max_input_tokens")
        assert self.context is not None
        if len(self.context) >= self.episode.budget:
            return self._end("max_input_tokens")
        turn = await self.episode.policy(self.context)
        if turn.finish_reason == "abort" or not turn.token_ids:
            raise TurnAborted(f"a turn came back {turn.finish_reason!r} with {len(turn.token_ids)} tokens")
        reply = vf.AssistantMessage(content=self.episode.codec.reply_text(turn.token_ids))
        response = vf.Response(
            id=f"asyncrl-{self.trace.num_turns}",
            created=0,
            model="asyncrl",
            message=reply,
            finish_reason=FINISH.get(turn.finish_reason),
            tokens=vf.TurnTokens(
                prompt_ids=list(self.context),
                completion_ids=list(turn.token_ids),
                completion_logprobs=list(turn.logprobs),
            ),
        )
        from verifiers.v1.graph import prepare_turn  # type: ignore[import-untyped]  # heavy: see __init__

        prepare_turn(self.trace, list(self.messages)).commit(response)
        self.messages.append(reply)
        self.context = self.context + list(turn.token_ids)
        self.last = (list(turn.token_ids), turn.finish_reason)
        if self.traj is not None:
            self.traj.turns.append(turn)
            self.traj.rewards.append(0.0)
            self.traj.observation_ids.append([])
        await self._check_stops(response)
        return vf.Segment(messages=[reply], root_reply=self.trace.root_reply)

    def _messages(self, message) -> list[Any]:
        vf = self.vf
        if message is None:
            return []
        if isinstance(message, str):
            return [vf.UserMessage(content=message)]
        from verifiers.v1.dialects import parse_message  # type: ignore[import-untyped]  # heavy: see __init__

        return [parse_message(m) if isinstance(m, dict) else m for m in message]

    def _end(self, condition: str) -> Any:
        self.over = True
        if condition == "max_input_tokens" and self.traj is not None:
            self.traj.context_full = True  # its samples are "length", as a native episode's (multiturn.py)
        self.trace.stop(condition)
        return self.vf.Segment(messages=[], terminated=True)

    async def _check_stops(self, response) -> None:
        from verifiers.v1.session import call_hook, hook_boundary  # type: ignore[import-untyped]  # heavy: see __init__

        vf = self.vf
        for fn in self.stops:
            boundary = hook_boundary(fn, allow_trace=True)
            if boundary is vf.Request:
                continue  # a request stop sees the request before sampling; not modelled here
            available = {vf.Response: response, vf.Trace: self.trace}
            if await call_hook(fn, available):
                self.over = True
                self.trace.stop(fn.__name__)
                return

    async def close(self, condition: str) -> Any:
        """Stop the trace (first condition wins), score it with the task's rewards and metrics."""
        if self.closed:
            return self.trace
        self.closed = True
        self.trace.stop(condition)
        try:
            await self.task.score(self.trace)
            self.trace.ok = True
        except Exception as e:  # the task's own scoring code: its failure is the sample's, as a reward's
            self.trace.record_error(e)
        self.episode.traces.append(self.trace)
        return self.trace


class Interaction:
    """The part of ``vf.Interaction`` environments use: ``turn``, ``trace``."""

    def __init__(self, conversation: Conversation):
        self._c = conversation

    @property
    def trace(self):
        return self._c.trace

    async def turn(self, message=None):
        return await self._c.turn(message)


class Seat:
    """One of the env's agents (``agents.<name>``) played by the engine."""

    def __init__(self, episode: Episode, name: str, config):
        if config.model is not None or config.client is not None:
            raise EpisodeError(
                f"agent {name!r} pins model={config.model!r} / a client: asyncrl samples every agent "
                f"from the policy it trains (its engine); unpin it"
            )
        self.episode, self.name, self.config = episode, name, config
        self.trainable = True

    async def run(self, task, *, runtime=None, tools=None, on_trace=None, collect_artifacts=False):
        if runtime is not None or tools or collect_artifacts:
            raise EpisodeError(f"agent {self.name!r}: runtimes, tools and artifacts are not supported")
        c = Conversation(self.episode, self, task)
        await c.turn(None)
        return await c.close("agent_completed")

    @asynccontextmanager
    async def interaction(self, task, *, runtime=None, tools=None, on_trace=None):
        if runtime is not None or tools:
            raise EpisodeError(f"agent {self.name!r}: runtimes and tools are not supported")
        c = Conversation(self.episode, self, task)
        try:
            yield Interaction(c)
        finally:
            if not c.closed:
                await c.close("user_closed")


class Episode:
    """What one episode's seats share: the policy, the codec, the context budget, the traces."""

    def __init__(self, policy: Policy, codec: TurnCodec, budget: int):
        self.policy, self.codec, self.budget = policy, codec, budget
        self.codec_tokenizer = getattr(codec, "tokenizer", None)
        self.seats: list[Seat] = []
        self.conversations: list[Conversation] = []
        self.traces: list[Any] = []
        """Closed traces, in completion order (the vf.Episode's)."""

    def seat(self, name: str, config) -> Seat:
        s = Seat(self, name, config)
        self.seats.append(s)
        return s


async def play_episode(env, task, policy: Policy, codec: TurnCodec, budget: int) -> EpisodeTrajectory:
    """``env.setup`` -> ``env.run`` -> ``env.finalize`` over engine-played agents; the trainable
    agent's trajectory with the trace's weighted reward as its return (NaN and ``error`` when the
    environment or the task's scoring failed)."""
    import verifiers.v1 as vf  # heavy: see Conversation

    episode = Episode(policy, codec, budget)
    agents = vf.Agents(env.config, episode.seat)
    name = type(env).__name__
    error = None
    try:
        await env.setup(agents)
        await env.run(task, agents)
    except (TurnAborted, EpisodeError, PromptSourceError, asyncio.CancelledError):
        raise  # a void turn, or asyncrl's own refusal: not the environment's failure
    except Exception as e:  # the environment's own code: recorded on the sample, as verifiers records it
        error = f"{name}.run raised {type(e).__name__}: {e}"
    record = vf.Episode(
        env=vf.EnvInfo(id=env.config.env_id),
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        traces=list(episode.traces),
    )
    if error is None:
        try:
            await env.finalize(task, record)
        except Exception as e:  # as above
            error = f"{name}.finalize raised {type(e).__name__}: {e}"
    return _trainable_trajectory(episode, name, error)


def _trainable_trajectory(episode: Episode, name: str, error: str | None) -> EpisodeTrajectory:
    played = [t for t in episode.traces if t.agent.trainable]
    if not played and error is not None:  # nothing to score: the group fails, as a native step() raising
        raise EpisodeError(error)
    if len(played) != 1:
        raise EpisodeError(
            f"{name}: an episode must leave exactly one trainable agent run (a sample), it left {len(played)}; "
            f"mark the others untrainable in setup() (agents.<name>.trainable = False)"
        )
    (trace,) = played
    traj = next(c.traj for c in episode.conversations if c.trace is trace)
    if traj is None or not traj.turns:
        raise EpisodeError(f"{name}: the trainable agent {trace.agent.name!r} sampled no turn")
    if error is None and trace.errors:
        error = f"scoring failed: {trace.errors[-1].type}: {trace.errors[-1].message}"
    reward = trace.reward if error is None else math.nan
    if error is None and not math.isfinite(reward):
        error, reward = f"the trace's reward is {reward!r}", math.nan
    traj.rewards[-1] = reward
    traj.error = error
    return traj
