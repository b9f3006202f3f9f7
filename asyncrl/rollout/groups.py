"""One prompt -> one scored RolloutGroup: n samples from the engine (single turn) or n
trajectories through the environment (multi-turn), each scored as the reward sees it.

    maker = GroupMaker(cfg, env, tokenizer, engine, "gen-0")
    group = await maker.make(PromptItem("gen-0.1:7", "abc=", {...}, ids))
    maker.scorer.errors, maker.scorer.timeouts   # rewards (and episode scorings) that raised / timed out, so far
    maker.uniform(group)                    # its rewards all tie: no gradient (rollout.drop_uniform_groups)

A failed reward, single-turn or an episode's (the tools env's reward, a verifiers environment's
scoring), goes through the scorer's rules (rollout/scoring.py) and its sample's index is noted
in the group's metadata (``REWARD_FAILED_KEY``), so dynamic sampling can tell a failure that
rollout.reward_on_failure stood in for from a reward the task gave.

Request ids come from the prompt id (unique in a run): ``prompt_id`` for a single-turn group,
``prompt_id/t{k}/{turn}`` per trajectory and turn, so every request's seed, and with it the
group, is fixed by (rollout.seed, prompt id, sample index) and the weights that sampled it.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, cast

import numpy as np

from asyncrl.algo.overlong import MAX_NEW_TOKENS_KEY, penalised_rewards, rewards_tie
from asyncrl.config import Config, ConfigError
from asyncrl.data.images import IMAGES_KEY, ImageLimits
from asyncrl.rollout.engine import RolloutEngine
from asyncrl.rollout.envs import RewardError, make_env
from asyncrl.rollout.envs.multiturn import (
    EPISODE_COUNTS_KEY,
    MultiTurnEnvironment,
    Trajectory,
    Turn,
    run_trajectory,
    to_interleaved_sample,
    to_step_samples,
)
from asyncrl.rollout.prompts import PromptItem
from asyncrl.rollout.scoring import RewardLimits, RewardScorer, Score
from asyncrl.rollout.teacher import TeacherClient, attach_teacher_logprobs
from asyncrl.rollout.vision_prompts import (
    PromptImageError,
    VisionModel,
    engine_prompt_ids,
    images_refused,
    prompt_images,
)
from asyncrl.types import RolloutGroup, Sample

REWARD_FAILED_KEY = "reward_failed"
"""Group metadata: the indices of the samples whose reward failed (NaN, or rollout.reward_on_failure
in its place); absent when none did."""
CONTEXT_FULL = "context_full"
"""A multi-turn group's episode count (rollout/context_full): episodes cut by the context budget."""


def failed_samples(group: RolloutGroup) -> set[int]:
    """The sample indices ``REWARD_FAILED_KEY`` notes (anything else in it is ignored)."""
    noted = group.metadata.get(REWARD_FAILED_KEY)
    if not isinstance(noted, list):
        return set()
    return {i for i in noted if isinstance(i, int) and not isinstance(i, bool)}


class GroupMaker:
    """Rolls prompts out on one engine and scores them off the loop (``scorer`` counts the
    rewards that failed)."""

    def __init__(
        self,
        cfg: Config,
        env,
        tokenizer,
        engine: RolloutEngine,
        generator_id: str,
        vision: VisionModel | None = None,
        image_limits: ImageLimits | None = None,
    ):
        self.cfg, self.rollout, self.env, self.tokenizer = cfg, cfg.rollout, env, tokenizer
        self.engine, self.generator_id = engine, generator_id
        # A vision-language model's placeholder, and the limits a prompt's images are held to.
        self.vision, self.image_limits = vision, image_limits or ImageLimits.of(cfg.rollout.images)
        # Multi-turn rewards come from env.step() inside the trajectory, not from a scorer.
        self.scorer = RewardScorer(env, RewardLimits.from_rollout(cfg.rollout))
        teacher = cfg.rollout.teacher
        self.teacher = TeacherClient(cfg.control.run_name, teacher.timeout_s) if teacher is not None else None
        # Multi-turn contexts: built (and a chat template that cannot grow turn by turn refused) once.
        chat = cfg.rollout.chat_template
        self.codec = cast(MultiTurnEnvironment, env).turn_codec(tokenizer, chat) if env.multi_turn else None
        self.soft_penalty = cfg.algo.overlong.soft_penalty
        if self.soft_penalty is not None and env.multi_turn:
            # The config rule knows the built-in environments; an import path is known only here.
            raise ConfigError(
                f"algo.overlong.soft_penalty is for single-turn environments: rollout.env={cfg.rollout.env!r} "
                f"is multi-turn (rollout.max_tokens bounds each turn, not the trajectory); use algo.overlong.mask"
            )

    async def make(
        self, item: PromptItem, n: int | None = None, temperature: float | None = None, teacher: bool = True
    ) -> RolloutGroup:
        """``n`` samples or trajectories (None: rollout.n_samples) at ``temperature`` (None:
        rollout.temperature); evaluation passes its own (asyncrl.rollout.evaluation), and
        ``teacher=False``: only trained samples need rollout.teacher's log-probs."""
        t0 = time.time()
        n = self.rollout.n_samples if n is None else n
        counts: dict[str, int] = {}
        failed: list[int] = []
        prompt_ids = item.ids
        if self.env.multi_turn:
            if IMAGES_KEY in item.metadata:  # the encoder refuses these first (images_refused)
                why = images_refused(self.rollout.env, True, False)
                raise PromptImageError(f"the prompt carries images, but {why}")
            samples, counts, failed = await self._multi_turn_samples(item, n, temperature)
        else:
            images = prompt_images(item.metadata, item.ids, self.vision, self.image_limits)
            if images and self.teacher is not None and teacher:
                raise PromptImageError(f"the prompt carries images, but {images_refused('', False, True)}")
            prompt_len = self.prompt_length(item.ids, item.metadata)
            max_tokens = item.metadata.get("max_tokens")  # per-prompt budget (long-tailed workloads)
            if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
                max_tokens = max(1, min(max_tokens, self.rollout.engine_max_model_len - prompt_len))
            else:
                max_tokens = None
            # metadata "ignore_eos": true runs every sample to the budget (EOS sampled or not), so
            # a benchmark can fix the work per prompt whatever lengths the policy drifts to.
            completions = await self.engine.generate(
                item.ids,
                n,
                item.prompt_id,
                max_tokens=max_tokens,
                temperature=temperature,
                ignore_eos=item.metadata.get("ignore_eos") is True,
                images=images or None,
            )
            # With images, the prompt the engine ran: its placeholders expanded to image tokens.
            ran = completions[0].prompt_ids if completions else None
            prompt_ids = engine_prompt_ids(item.ids, ran, len(images), self.vision)
            # Scored concurrently: one slow reward holds up its own group only, never the loop.
            scored = await asyncio.gather(*(self._sample(item.text, item.metadata, c, t0) for c in completions))
            samples = [s for s, _ in scored]
            failed = [i for i, (_, score) in enumerate(scored) if score.failed]
            for _, score in scored:  # a reward's own counts (the code env's tests, timeouts...)
                for name, k in score.counts.items():
                    counts[name] = counts.get(name, 0) + k
        if self.teacher is not None and teacher:
            failed = await attach_teacher_logprobs(self.teacher, self.scorer, item.ids, samples, failed)
        # How in-flight requests met a weight update; "keep" means later tokens may have attended
        # to KV computed by older weights (a correction the learner may want to know about).
        meta = dict(item.metadata, inflight=self.cfg.sync.inflight)
        if counts:
            meta[EPISODE_COUNTS_KEY] = counts  # summed per step by the trainer (rollout/<name>)
        if failed:
            meta[REWARD_FAILED_KEY] = failed
        if self.soft_penalty is not None and not self.env.multi_turn:
            meta[MAX_NEW_TOKENS_KEY] = max_tokens or self.rollout.max_tokens  # the penalty's L_max
        if self.cfg.sync.inflight == "keep" and any(
            s.token_versions is not None
            and s.token_versions.size > 0
            and (len(set(s.token_versions.tolist())) > 1 or s.behavior_version < s.token_versions.min())
            for s in samples
        ):
            meta["stale_kv"] = True  # tokens after a mid-request update attended to older weights' KV
        # One group per prompt: a prompt re-issued after a crash that had in fact been put
        # carries the same id, so the queue drops the duplicate instead of training it twice.
        return RolloutGroup(
            group_id=item.prompt_id,
            prompt_id=item.prompt_id,
            prompt_ids=np.asarray(prompt_ids, np.int32),
            samples=samples,
            env=self.rollout.env,
            metadata=meta,
        )

    def prompt_length(self, ids: list[int], metadata: dict) -> int:
        """The prompt's length as the engine runs it: a vision-language model's image placeholders
        expanded to the image tokens (where their count is fixed), else the ids as they are."""
        images = metadata.get(IMAGES_KEY)
        if self.vision is None or not isinstance(images, list) or not images:
            return len(ids)
        return self.vision.expanded_length(ids, len(images)) or len(ids)

    def uniform(self, group: RolloutGroup) -> bool:
        """Whether every reward the advantage estimator will see for ``group`` is the same
        (asyncrl.data.batch: failed rewards left out, algo.overlong's soft penalty added,
        step-wise the last step of each trajectory), so every group-baseline advantage is 0.

        Failed rewards take no part in the verdict, whether NaN or rollout.reward_on_failure
        stood in for them: a group none of whose rewards the task gave is not uniform (its
        failure must reach the trainer: a reward outage is not a solved task), and one with a
        stand-in is dropped only if the rewards the task gave tie with it too."""
        soft = self.soft_penalty
        rewards = penalised_rewards(
            group,
            soft.buffer if soft else None,
            soft.coef if soft else 1.0,
            default_max_new_tokens=self.rollout.max_tokens,
        )
        samples = list(enumerate(group.samples))
        if self.cfg.algo.stepwise:  # a trajectory's advantage comes from its last step's reward
            last: dict[int, tuple[int, Sample]] = {}
            for i, s in samples:
                if s.trajectory_id not in last or s.step_index > last[s.trajectory_id][1].step_index:
                    last[s.trajectory_id] = (i, s)
            samples = list(last.values())
        failed = failed_samples(group)
        seen = [(i, rewards[i]) for i, s in samples if s.error is None and np.isfinite(rewards[i])]
        if not any(i not in failed for i, _ in seen):
            return False
        return rewards_tie([r for _, r in seen])

    async def _sample(self, prompt: str, metadata: dict, c, t0: float) -> tuple[Sample, Score]:
        """The sample, and its scoring (whether its reward failed, the reward's counts)."""
        score = await self.scorer.score_completion(self.tokenizer, prompt, c.token_ids, metadata)
        n = len(c.token_ids)
        versions = list(c.versions) or [self.engine.version]
        if self.cfg.sync.inflight == "keep" and c.submitted_version is not None:
            # Submitted before an update but run after it: its prompt may have come from the
            # prefix cache of the weights it was submitted under, so those are the oldest that
            # shaped it (its tokens alone would all say the newer version).
            versions.append(c.submitted_version)
        sample = Sample(
            response_ids=np.asarray(c.token_ids, np.int32),
            rollout_logprobs=np.asarray(c.logprobs, np.float32),
            loss_mask=np.ones(n, np.uint8),
            reward=score.reward,
            behavior_version=min(versions),
            stop_reason=c.finish_reason,
            token_versions=np.asarray(c.versions, np.int32),
            generator_id=self.generator_id,
            timings={"generate_s": time.time() - t0, "finished_at": time.time()},
            error=score.error,
            routed_experts=c.routed_experts,
        )
        return sample, score

    async def _multi_turn_samples(
        self, item: PromptItem, n: int, temperature: float | None
    ) -> tuple[list[Sample], dict[str, int], list[int]]:
        """The group's samples, its episode counts and the indices of its failed samples."""
        assert self.codec is not None
        codec = self.codec
        budget = self.rollout.engine_max_model_len - self.rollout.max_tokens

        async def one(k: int):
            turns = 0

            async def policy(context: list[int]) -> Turn:
                nonlocal turns
                turns += 1
                request_id = f"{item.prompt_id}/t{k}/{turns}"
                c = (await self.engine.generate(context, 1, request_id, temperature=temperature))[0]
                return Turn(c.token_ids, c.logprobs, c.versions, c.finish_reason)

            if getattr(self.env, "drives_episodes", False):  # a library environment runs its own episode loop
                return await self.env.run_episode(item.text, item.metadata, policy, codec, budget)
            # Episode state is per trajectory. multi_turn (checked by make()) means a stepped env.
            env = cast(MultiTurnEnvironment, make_env(self.rollout.env, self.rollout.env_kwargs))
            return await run_trajectory(env, item.text, item.metadata, policy, codec, budget)

        tasks = [asyncio.ensure_future(one(k)) for k in range(n)]
        try:
            trajectories = await asyncio.gather(*tasks)
        except BaseException:  # one void trajectory voids the group (it is re-issued): stop the others
            for t in tasks:
                t.cancel()
            raise
        counts: dict[str, int] = {CONTEXT_FULL: 0}
        for t in trajectories:
            counts[CONTEXT_FULL] += int(t.context_full)
            for name, n in t.counts.items():
                counts[name] = counts.get(name, 0) + int(n)
        # An episode whose scoring failed: as a failed reward (rollout/scoring.py), once per episode.
        scores = [self._episode_score(t) for t in trajectories]
        if self.cfg.algo.stepwise:
            samples = [s for k, t in enumerate(trajectories) for s in to_step_samples(t, k, self.generator_id)]
        else:
            samples = [to_interleaved_sample(t, self.generator_id) for t in trajectories]
        failed = []
        for k, s in enumerate(samples):
            score = scores[s.trajectory_id if self.cfg.algo.stepwise else k]
            if score is not None:
                s.reward, s.error = score.reward, score.error
                failed.append(k)
        return samples, counts, failed

    def _episode_score(self, traj: Trajectory) -> Score | None:
        """The shared rules' score of an episode whose scoring failed, None if it did not."""
        failure = traj.reward_failure
        error: Any = getattr(traj, "error", None)  # a library environment's (verifiers) scoring failure
        if failure is None and error is not None:
            failure = RewardError(str(error))
        if failure is None and math.isfinite(traj.total_reward):
            self.scorer.succeeded()
            return None
        return self.scorer.failed(failure or RewardError(f"the episode's return is {traj.total_reward}"))
