"""What a decoded rollout group must satisfy to be trained by this run.

    contract = RecordContract(vocab_size=64, max_len=64, group_size=8, stepwise=False, max_version=31)
    check_group(group, contract)          # None, or raises codec.RecordError(reason)

The codec (codec.py) checks that a record is well formed: types, dtypes, shapes, lengths that
agree, finite log-probs, 0/1 masks. This checks it against the run that reads it: token ids the
model has, sequences the engine and the learner can hold, the run's group size, behaviour
versions that exist yet. A record that fails either is dead-lettered at intake (asyncrl.queue.intake)
with the reason: the learner never sees it, so a generator with another tokenizer, a bug or a
writer holding the queue's password cannot end the run at the next train step.

Rules, each a `RecordError.reason`:

- ``token_out_of_range``: a prompt or response id outside [0, vocab_size).
- ``too_long`` / ``empty_prompt``: prompt + response (the sample's own prompt when it has one)
  longer than ``max_len`` (the engine's max model length, capped by the learner's positions),
  or no prompt token (the first response token would be scored without context).
- ``positive_logprob``: a rollout log-prob above ``LOGPROB_TOLERANCE``. A log-probability is
  <= 0; vLLM's float32 log-softmax can round a near-certain token to a hair above 0, so the
  tolerance is the one the learner's own check allows (asyncrl.learner.validate).
- ``future_version``: a behaviour or token version above ``max_version``, the learner's
  current version. Weights are announced only after the learner made them, so no honest
  generator can hold newer ones (a resume renumbers past every version a crashed run announced).
  Versions below the staleness bound are the queue's ordinary stale drop, not a contract breach.
- ``bad_token_version``: a negative per-token version.
- ``group_size``: not ``group_size`` samples (step-wise multi-turn: not exactly the trajectories
  0..group_size-1, or one step twice).
- ``reward_out_of_range``: |reward| or a per-token |reward| above ``types.MAX_ABS_REWARD`` (finite,
  yet its group's advantages would not be).
- ``nonfinite_reward``: a NaN per-token reward on a sample whose reward succeeded (NaN is the
  failure marker only together with a failed outcome: ``error`` set or the reward NaN).
- ``bad_id``: a group, prompt or generator id longer than ``MAX_ID_CHARS``.
- ``missing_teacher_logprobs``: the run distils (rollout.teacher) and a sample whose reward
  succeeded has no teacher log-probs (a generator of another config): trained, it would be
  plain RL without the teacher's signal. ``positive_logprob`` covers them too (the teacher's
  are computed in float32 as the learner's are; non-finite ones are the codec's).
- ``bad_image``: the run takes images (``images`` set) and the group's prompt images
  (metadata ``images``, asyncrl.data.images) are not a list of at most ``max_images`` PNGs, each
  within ``max_bytes`` and ``max_pixels`` and decodable; or the run is a text run and the group
  carries prompt images (its generators refuse them: it was sampled elsewhere, and would be
  trained on its text alone). Images are checked once per group: they travel once per group,
  not per sample.
- ``logprob_out_of_range``: a rollout or teacher log-prob of a policy token below ``types.MIN_LOGPROB`` (finite,
  yet under rollout.teacher it is the token's reward, and its advantage would swamp the batch's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from asyncrl.data.codec import RecordError
from asyncrl.data.images import IMAGES_KEY, ImageLimits, check_group_images
from asyncrl.types import MAX_ABS_REWARD, MIN_LOGPROB, RolloutGroup, Sample

LOGPROB_TOLERANCE = 1e-4
"""Largest rollout log-prob accepted (float32 rounding of log-softmax near probability 1)."""
MAX_ID_CHARS = 1024
"""Longest group, prompt or generator id: they go into logs, sets and the ledger."""


@dataclass(frozen=True)
class RecordContract:
    """The run a record must fit (built by the trainer from its config and learner)."""

    vocab_size: int
    max_len: int
    """Most tokens in prompt + response."""
    group_size: int
    """rollout.n_samples: samples (or step-wise trajectories) per group."""
    stepwise: bool
    """algo.stepwise: a group holds every step of its trajectories."""
    max_version: int
    """The learner's current version: no behaviour version can be newer."""
    teacher: bool = False
    """rollout.teacher is set: every sample whose reward succeeded carries teacher log-probs."""
    images: ImageLimits | None = None
    """The run's prompts carry images within these limits (None: a text run, images unchecked)."""


def _check_ids(ids: np.ndarray, vocab_size: int, where: str) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise RecordError(
            "token_out_of_range", f"{where}: ids in [{int(ids.min())}, {int(ids.max())}], vocabulary [0, {vocab_size})"
        )


def _check_sample(group: RolloutGroup, s: Sample, c: RecordContract, where: str) -> None:
    if len(s.generator_id) > MAX_ID_CHARS:
        raise RecordError("bad_id", f"{where}.generator_id: {len(s.generator_id)} characters > {MAX_ID_CHARS}")
    prompt = s.prompt_ids if s.prompt_ids is not None else group.prompt_ids
    if s.prompt_ids is not None:
        _check_ids(s.prompt_ids, c.vocab_size, f"{where}.prompt_ids")
    _check_ids(s.response_ids, c.vocab_size, f"{where}.response_ids")
    total = int(prompt.shape[0]) + s.num_tokens
    if prompt.shape[0] == 0:
        # Its first response token would be scored without context (in a packed row: from the
        # previous sequence's last logits).
        raise RecordError("empty_prompt", f"{where}: no prompt token ({s.num_tokens} response tokens)")
    if total > c.max_len:
        raise RecordError(
            "too_long", f"{where}: {prompt.shape[0]} prompt + {s.num_tokens} response tokens > {c.max_len}"
        )
    if s.rollout_logprobs.size and float(s.rollout_logprobs.max()) > LOGPROB_TOLERANCE:
        raise RecordError(
            "positive_logprob", f"{where}.rollout_logprobs: {float(s.rollout_logprobs.max())} > {LOGPROB_TOLERANCE}"
        )
    _check_floor(s.rollout_logprobs, s.loss_mask, f"{where}.rollout_logprobs")
    _check_teacher(s, c, where, succeeded=s.error is None and math.isfinite(s.reward))
    if s.behavior_version > c.max_version:
        raise RecordError(
            "future_version", f"{where}.behavior_version {s.behavior_version} > learner's {c.max_version}"
        )
    tv = s.token_versions
    if tv is not None and tv.size:
        if int(tv.max()) > c.max_version:
            raise RecordError(
                "future_version", f"{where}.token_versions up to {int(tv.max())} > learner's {c.max_version}"
            )
        if int(tv.min()) < 0:
            raise RecordError("bad_token_version", f"{where}.token_versions: {int(tv.min())} < 0")
    succeeded = s.error is None and math.isfinite(s.reward)
    if succeeded and s.token_rewards is not None and not np.isfinite(s.token_rewards).all():
        raise RecordError("nonfinite_reward", f"{where}.token_rewards: NaN on a sample whose reward succeeded")
    if math.isfinite(s.reward) and abs(s.reward) > MAX_ABS_REWARD:
        raise RecordError("reward_out_of_range", f"{where}.reward {s.reward:.3g}: |reward| > {MAX_ABS_REWARD:g}")
    if s.token_rewards is not None and s.token_rewards.size:
        big = float(np.nanmax(np.abs(s.token_rewards))) if not np.isnan(s.token_rewards).all() else 0.0
        if big > MAX_ABS_REWARD:
            raise RecordError("reward_out_of_range", f"{where}.token_rewards up to {big:.3g} > {MAX_ABS_REWARD:g}")


def _check_teacher(s: Sample, c: RecordContract, where: str, *, succeeded: bool) -> None:
    t = s.teacher_logprobs
    if t is None:
        if c.teacher and succeeded:
            raise RecordError(
                "missing_teacher_logprobs", f"{where}: the run distils from rollout.teacher and this sample has none"
            )
        return
    if t.size and float(t.max()) > LOGPROB_TOLERANCE:
        raise RecordError("positive_logprob", f"{where}.teacher_logprobs: {float(t.max())} > {LOGPROB_TOLERANCE}")
    _check_floor(t, s.loss_mask, f"{where}.teacher_logprobs")


def _check_floor(logprobs: np.ndarray, loss_mask: np.ndarray, where: str) -> None:
    """Policy tokens only: an observation token's log-prob is never trained (nor summed)."""
    live = logprobs[loss_mask > 0]
    if live.size and float(live.min()) < MIN_LOGPROB:
        raise RecordError("logprob_out_of_range", f"{where}: {float(live.min()):.3g} < {MIN_LOGPROB:g}")


def _check_group_size(group: RolloutGroup, c: RecordContract) -> None:
    if not c.stepwise:
        if len(group.samples) != c.group_size:
            raise RecordError("group_size", f"{len(group.samples)} samples, the run's groups have {c.group_size}")
        return
    steps = {(s.trajectory_id, s.step_index) for s in group.samples}
    trajectories = {s.trajectory_id for s in group.samples}
    if len(steps) != len(group.samples) or trajectories != set(range(c.group_size)):
        raise RecordError(
            "group_size",
            f"{len(group.samples)} steps of trajectories {sorted(trajectories)[:8]}: expected each step once, "
            f"trajectories 0..{c.group_size - 1}",
        )


def check_group(group: RolloutGroup, contract: RecordContract) -> None:
    """Raise RecordError(reason) if `group` does not fit the run (see the module docstring)."""
    for name in ("group_id", "prompt_id"):
        value = getattr(group, name)
        if len(value) > MAX_ID_CHARS:
            raise RecordError("bad_id", f"group.{name}: {len(value)} characters > {MAX_ID_CHARS}")
    _check_group_size(group, contract)
    _check_ids(group.prompt_ids, contract.vocab_size, "group.prompt_ids")
    if contract.images is not None:
        check_group_images(group.metadata, contract.images)
    elif group.metadata.get(IMAGES_KEY, []) != []:
        # A text run's generators refuse prompt images (asyncrl.rollout.vision_prompts): a group
        # with some was sampled elsewhere, and its learner would train on the text alone.
        raise RecordError("bad_image", "the group carries prompt images, but the run's model is a text model")
    for i, s in enumerate(group.samples):
        _check_sample(group, s, contract, f"samples[{i}]")
