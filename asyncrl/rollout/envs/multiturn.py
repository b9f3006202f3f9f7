"""Multi-turn environments and the step-wise trajectories they produce.

    env = make_env("countdown_chat")                  # one instance per trajectory (it holds state)
    prompt, meta = env.make_prompt(rng)               # "5>"
    first_obs = env.reset(prompt, meta)               # "5>"
    obs, reward, done = env.step("4")                 # (";4>", 0.333.., False)

``run_trajectory`` drives one episode with any async policy ``(context_ids) -> Turn``
(the generator passes its vLLM engine) and returns a ``Trajectory``; it becomes either
one Sample per step (``to_step_samples``: each step's prompt is the whole context so
far, every step carries the trajectory's return, as step-wise GRPO wants) or one
interleaved Sample (``to_interleaved_sample``: observation tokens with loss_mask 0).

Every sample carries its own ``prompt_ids``: the ids the engine was given for its first
token, so the learner conditions on exactly what the engine sampled from (the group's
``prompt_ids`` are never substituted). A ``TurnCodec`` (``chat.py``) turns the text into
ids: the first prompt as single-turn prompts are encoded (rollout.chat_template
respected), the engine's replies as sampled, observations as chat turns or bare text.

An episode cut by the context budget (no room for another turn before the environment ended
it) is scored by the environment's ``truncated`` (a reward called on the last reply, by an
environment that scores only at the end) and marked ``context_full``: its samples' stop reason
is "length", so algo.overlong.mask leaves them out of the loss as it does a reply cut at
rollout.max_tokens, and the generator counts it (rollout/context_full).

A turn the engine aborted (its request cancelled, e.g. by an engine rebuild) or that holds
no token raises ``TurnAborted``: the episode cannot go on from a torn reply, and a
trajectory cut there would be trained with a return the environment never gave. The
generator then runs the prompt again under the same id (the group is whole or not at
all, and counted in ``group_errors``).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.algo.overlong import TRUNCATED
from asyncrl.rollout.envs.base import Environment, RewardError
from asyncrl.rollout.envs.chat import Observation, TurnCodec, turn_codec
from asyncrl.types import Sample

EPISODE_COUNTS_KEY = "episode_counts"
"""A multi-turn group's metadata entry: its trajectories' ``episode_counts()`` summed."""


class MultiTurnEnvironment(Environment):
    """A stepped task. Instances hold one episode's state: build one per trajectory."""

    multi_turn = True
    max_turns = 4
    observation_role = "user"
    """The chat role observations take with rollout.chat_template (e.g. "tool" for tool output)."""
    reward_failure: RewardError | None = None
    """Set by an environment whose own reward call failed (the tools env's): the generator then
    applies the shared rules to the episode (rollout.reward_on_failure, rollout/reward_errors)."""

    def reset(self, prompt: str, metadata: dict[str, Any]) -> str:
        """Start an episode; return the first observation (usually the prompt itself)."""
        raise NotImplementedError

    def step(self, response: str) -> tuple[str, float, bool]:
        """Consume the model's reply; return (next observation, this step's reward, done)."""
        raise NotImplementedError

    async def astep(self, response: str) -> tuple[Observation, float, bool]:
        """What trajectories call: ``step`` unless overridden by an environment that awaits
        work off the generator's loop (tool calls) or answers with chat messages."""
        return self.step(response)

    def turn_codec(self, tokenizer, chat_template: bool) -> TurnCodec:
        """How this environment's episodes become ids (one codec serves all its trajectories)."""
        return turn_codec(tokenizer, chat_template=chat_template, role=self.observation_role)

    async def truncated(self, response: str) -> float:
        """The episode was cut by the context budget right after the reply ``response``: the
        reward to add to that last step's. 0 here (a stepped environment's rewards came with
        each step); an environment that scores only at the end scores the episode here."""
        return 0.0

    def episode_counts(self) -> dict[str, int]:
        """Counts of this episode (e.g. tool calls) that the trainer sums per step into
        ``rollout/<name>`` for the names the metric catalogue knows."""
        return {}

    def reward(self, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        raise TypeError(f"{type(self).__name__} is multi-turn: use reset/step, not reward")


@dataclass
class Turn:
    """What the policy produced for one step."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = "stop"


@dataclass
class Trajectory:
    """One episode: the initial prompt ids, then per step the policy turn, its reward and the
    observation ids that followed (empty after the last step: no turn was sampled after it)."""

    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    observation_ids: list[list[int]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    """The environment's ``episode_counts()`` at the end."""
    context_full: bool = False
    """Cut by the context budget before the environment ended it: its samples are "length"."""
    reward_failure: RewardError | None = None
    """The environment's reward call failed (its return is NaN until the generator's rules apply)."""

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))


Policy = Callable[[list[int]], Awaitable[Turn]]


class TurnAborted(RuntimeError):
    """A turn came back aborted or empty: the episode is void (see the module doc)."""


async def run_trajectory(
    env: MultiTurnEnvironment,
    prompt: str,
    metadata: dict[str, Any],
    policy: Policy,
    codec: TurnCodec,
    max_context_tokens: int,
) -> Trajectory:
    """Alternate policy turns and env steps until done, max_turns, or the context is full.

    The context handed to the policy is always ``prompt_ids`` + (turn + observation)... with
    the turns' ids as sampled: the samples built from the trajectory rebuild it the same way."""
    traj = Trajectory(prompt_ids=codec.prompt(env.reset(prompt, metadata)))
    context = list(traj.prompt_ids)
    for k in range(env.max_turns):
        turn = await policy(context)
        if turn.finish_reason == "abort" or not turn.token_ids:
            raise TurnAborted(
                f"turn {k} came back {turn.finish_reason!r} with {len(turn.token_ids)} tokens: "
                f"the episode cannot go on from it"
            )
        if not len(turn.versions) == len(turn.logprobs) == len(turn.token_ids):
            raise ValueError(
                f"turn {k}: {len(turn.token_ids)} tokens, {len(turn.logprobs)} logprobs, {len(turn.versions)} versions"
            )
        traj.turns.append(turn)
        observation, reward, done = await env.astep(codec.reply_text(turn.token_ids))
        traj.rewards.append(float(reward))
        traj.observation_ids.append([])
        context = context + list(turn.token_ids)  # a new list: the policy may keep the one it got
        if done or k + 1 == env.max_turns:
            break
        if len(context) < max_context_tokens:
            obs_ids = codec.observation(observation, turn.token_ids, turn.finish_reason)
            if len(context) + len(obs_ids) < max_context_tokens:
                traj.observation_ids[-1] = obs_ids
                context = context + obs_ids
                continue
        # No room for another turn (the observation, if any, was never seen): the environment
        # did not end the episode, so it is scored as cut, not left at the steps' rewards so far.
        traj.context_full = True
        traj.rewards[-1] += float(await env.truncated(codec.reply_text(turn.token_ids)))
        break
    traj.counts = dict(env.episode_counts())
    traj.reward_failure = env.reward_failure
    return traj


def to_step_samples(traj: Trajectory, trajectory_id: int, generator_id: str = "") -> list[Sample]:
    """One Sample per step; step k's prompt is prompt + (turn_j + obs_j for j < k)."""
    samples, context = [], list(traj.prompt_ids)
    for k, turn in enumerate(traj.turns):
        n = len(turn.token_ids)
        samples.append(
            Sample(
                response_ids=np.asarray(turn.token_ids, np.int32),
                rollout_logprobs=np.asarray(turn.logprobs, np.float32),
                loss_mask=np.ones(n, np.uint8),
                reward=traj.total_reward,
                behavior_version=min(turn.versions),
                # A cut episode's return is every step's: overlong masking must see each of them.
                stop_reason=TRUNCATED if traj.context_full else turn.finish_reason,
                token_versions=np.asarray(turn.versions, np.int32),
                generator_id=generator_id,
                prompt_ids=np.asarray(context, np.int32),
                trajectory_id=trajectory_id,
                step_index=k,
            )
        )
        context = context + list(turn.token_ids) + traj.observation_ids[k]
    return samples


def to_interleaved_sample(traj: Trajectory, generator_id: str = "") -> Sample:
    """One Sample whose response interleaves turns (loss_mask 1) and observations (loss_mask 0);
    its prompt_ids are the first prompt's, so prompt + response is the last turn's context
    plus that turn. Observation tokens carry the version of the turn before them."""
    if not traj.turns:
        raise ValueError("a trajectory with no turns makes no sample")
    ids, logps, mask, versions = [], [], [], []
    for turn, obs in zip(traj.turns, traj.observation_ids, strict=True):
        ids += turn.token_ids
        logps += turn.logprobs
        mask += [1] * len(turn.token_ids)
        versions += turn.versions
        ids += obs
        logps += [0.0] * len(obs)
        mask += [0] * len(obs)
        versions += [versions[-1]] * len(obs)
    return Sample(
        response_ids=np.asarray(ids, np.int32),
        rollout_logprobs=np.asarray(logps, np.float32),
        loss_mask=np.asarray(mask, np.uint8),
        reward=traj.total_reward,
        behavior_version=min(v for t in traj.turns for v in t.versions),
        stop_reason=TRUNCATED if traj.context_full else traj.turns[-1].finish_reason,
        token_versions=np.asarray(versions, np.int32),
        generator_id=generator_id,
        prompt_ids=np.asarray(traj.prompt_ids, np.int32),
    )


class CountdownChatEnv(MultiTurnEnvironment):
    """Count down one step per turn: observation '5>' expects the reply '4', then ';4>' expects '3'...

    Each correct reply earns 1/turns (digit-wise partial credit otherwise), so the return
    lies in [0, 1]. The env always states the true count, so one wrong turn does not doom
    the rest. Episodes end at 0 or after ``max_turns`` turns.
    """

    def __init__(self, start_min: int = 3, start_max: int = 9, max_turns: int = 3):
        if not 1 <= start_min <= start_max <= 9:
            raise ValueError(f"need 1 <= start_min <= start_max <= 9, got {start_min}, {start_max}")
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns}: must be >= 1")
        self.start_min, self.start_max, self.max_turns = start_min, start_max, max_turns
        self.count = 0
        self.turn = 0
        self.turns_total = 0

    def make_prompt(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        start = rng.randint(self.start_min, self.start_max)
        return f"{start}>", {"start": start}

    def reset(self, prompt: str, metadata: dict[str, Any]) -> str:
        start = metadata.get("start")
        if start is None:
            if not (prompt.endswith(">") and prompt[:-1].isdigit()):
                raise ValueError(f"countdown_chat: prompt {prompt!r} is not of the form '<digit>>'")
            start = int(prompt[:-1])
        self.count, self.turn = int(start), 0
        self.turns_total = min(self.max_turns, self.count)
        return prompt

    def step(self, response: str) -> tuple[str, float, bool]:
        if self.turn >= self.turns_total:
            raise RuntimeError("countdown_chat: step() after the episode ended; call reset() first")
        target = str(self.count - 1)
        # Lengths may differ: the overlap is scored, the length error is penalised below.
        hits = sum(1 for r, t in zip(response, target, strict=False) if r == t)
        credit = hits / len(target) - 0.05 * abs(len(response) - len(target))
        self.count -= 1
        self.turn += 1
        done = self.turn >= self.turns_total
        return f";{self.count}>", credit / self.turns_total, done
