"""Driver-side batch assembly: rollout groups in, mini-batches of TrainSequence out.

    minibatches, metrics = build_minibatches(groups, cfg.algo, num_minibatches=2)
    for mb in minibatches:            # one optimizer step each
        learner.train(mb)             # cut into micro-batches / ranks however it likes

Steps, all on the driver so that every number that spans the mini-batch is computed once:
1. Samples whose reward failed (NaN/inf reward, or ``error`` set) are excluded: they take
   no part in the group statistics, and their loss mask is zeroed (the record stays, so
   counts and versions stay honest, but it carries no gradient and no reduction weight).
   ``algo.overlong`` (DAPO, asyncrl.algo.overlong): ``soft_penalty`` adds the length penalty
   to each reward before the estimator sees it; ``mask`` zeroes the loss mask of truncated
   samples (finish reason 'length'), which still count in their group's baseline.
2. Advantages from the configured estimator, with the group id per sample; with
   ``rollout.teacher`` (on-policy distillation, asyncrl.algo.distill) each sample's
   per-token teacher term -coef * (rollout logp - teacher logp) is added on its loss mask
   (observation tokens of multi-turn samples have none). Step-wise
   (``algo.stepwise``): one scalar per trajectory (its last step's reward), broadcast to
   every step on the step's own mask; then consecutive steps sharing a prefix are merged.
   Only the last step's reward counts: earlier steps' rewards are ignored (may be NaN), and
   a trajectory whose last reward failed is excluded as a whole.
3. The groups are split into ``num_minibatches`` contiguous mini-batches of whole groups.
4. Reduction weights per mini-batch over all its sequences (``asyncrl.algo.reduction``;
   ``prompt_mean`` groups them by rollout group, i.e. by prompt).
5. ``TrainSequence``: input_ids = prompt + response, the prompt being the sample's own
   ``prompt_ids`` when it has them (every multi-turn sample: what the engine was given),
   else the group's; rollout_logprobs, advantages and
   loss_mask at the response positions (position t predicts input_ids[t]); token_versions
   from the sample's token_versions, else its behavior_version. With ``algo.critic``
   (estimator gae) the advantages are left 0 and each sequence carries its per-token rewards
   (``token_rewards``): the learner computes GAE with its critic's values at train time.
   With ``pixels`` (a vision-language model, asyncrl.data.pixels) each group's images become
   pixel values once and every sequence of the group carries them; a group whose images do
   not decode or whose prompt's image tokens do not match them is left out of the loss like a
   failed reward (``vision/refused_samples``, the reason logged), its image tokens replaced by
   the pad id so that no forward looks for features it does not have; so is a sample whose
   response holds the image token.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from itertools import pairwise

import numpy as np
import torch

from asyncrl.algo.advantages import AdvantageParams, get_advantage_estimator
from asyncrl.algo.distill import reverse_kl_per_token, teacher_advantages
from asyncrl.algo.overlong import is_truncated, penalised_rewards
from asyncrl.algo.reduction import reduction_weights
from asyncrl.algo.stepwise import broadcast_trajectory_advantages, merge_prefix_steps
from asyncrl.config import AlgoConfig
from asyncrl.config.teacher import TeacherConfig
from asyncrl.data.codec import RecordError
from asyncrl.data.pixels import ImagePixels, PixelInputs
from asyncrl.types import PER_TOKEN_ARRAYS, RolloutGroup, Sample, TrainSequence


@dataclass
class _Row:
    """One sample (or step) on its way to a TrainSequence."""

    group_index: int
    sample_index: int
    sample: Sample
    prompt: np.ndarray
    valid: bool
    reward: float
    """What the estimator sees: the sample's reward plus algo.overlong's soft penalty, if on."""
    overlong_masked: bool = False
    """Truncated and algo.overlong.mask is on: no loss, no reduction weight (still in the baseline)."""
    pixels: PixelInputs | None = None
    """The prompt's images, for a vision-language model."""


log = logging.getLogger(__name__)


def _check_sample(g: RolloutGroup, i: int, s: Sample) -> None:
    n = s.response_ids.shape[0]
    for name in PER_TOKEN_ARRAYS:
        arr = getattr(s, name)
        if arr is not None and arr.shape != (n,):
            raise ValueError(f"group {g.group_id!r} sample {i}: {name} has shape {arr.shape}, response has {n} tokens")


def _is_valid(s: Sample) -> bool:
    return s.error is None and math.isfinite(s.reward)


def _rows(groups: list[RolloutGroup], algo: AlgoConfig, max_new_tokens: int | None) -> list[_Row]:
    rows = []
    soft, mask = algo.overlong.soft_penalty, algo.overlong.mask
    for gi, g in enumerate(groups):
        if not g.samples:
            raise ValueError(f"group {g.group_id!r} has no samples")
        rewards = penalised_rewards(
            g, soft.buffer if soft else None, soft.coef if soft else 1.0, default_max_new_tokens=max_new_tokens
        )
        for si, s in enumerate(g.samples):
            _check_sample(g, si, s)
            prompt = s.prompt_ids if s.prompt_ids is not None else g.prompt_ids
            masked = mask and is_truncated(s.stop_reason)
            rows.append(_Row(gi, si, s, prompt, _is_valid(s), float(rewards[si]), masked))
    return rows


def _attach_pixels(rows: list[_Row], groups: list[RolloutGroup], pixels: ImagePixels, pad_token_id: int) -> int:
    """Each row's pixel inputs (one encoding per group); a refused row is left out of the loss
    and loses its image tokens (module docstring). Returns the number refused."""
    encoded: dict[int, PixelInputs | RecordError] = {}
    refused = 0
    for r in rows:
        if r.group_index not in encoded:
            try:
                encoded[r.group_index] = pixels.encode(groups[r.group_index].metadata)
            except RecordError as e:
                encoded[r.group_index] = e
        got = encoded[r.group_index]
        try:
            if isinstance(got, RecordError):
                raise got
            pixels.check_tokens(r.prompt, got)
            pixels.check_response(r.sample.response_ids)
            r.pixels = got
        except RecordError as e:
            g = groups[r.group_index]
            log.warning("group %r sample %d: not trained (%s: %s)", g.group_id, r.sample_index, e.reason, e.detail)
            r.valid = False
            r.prompt = _without(r.prompt, pixels.image_token_id, pad_token_id)
            r.sample = replace(
                r.sample, response_ids=_without(r.sample.response_ids, pixels.image_token_id, pad_token_id)
            )
            r.pixels = pixels.empty()
            refused += 1
    return refused


def _without(ids: np.ndarray, token: int, pad_token_id: int) -> np.ndarray:
    return np.where(ids == token, pad_token_id, ids).astype(ids.dtype)


def _padded(arrays: list[np.ndarray], dtype=torch.float64) -> torch.Tensor:
    width = max((a.shape[0] for a in arrays), default=0)
    out = torch.zeros(len(arrays), max(width, 1), dtype=dtype)
    for i, a in enumerate(arrays):
        out[i, : a.shape[0]] = torch.as_tensor(a.astype(np.float64))
    return out


def _response_mask(r: _Row) -> np.ndarray:
    return r.sample.loss_mask.astype(np.float64) * (1.0 if r.valid and not r.overlong_masked else 0.0)


def _advantage_params(algo: AlgoConfig) -> AdvantageParams:
    return AdvantageParams(norm_std=algo.grpo_norm_std, gamma=algo.gamma, lam=algo.lam)


def _token_rewards(r: _Row, outcome: float | None = None) -> np.ndarray:
    """The sample's per-token rewards, or its outcome reward (``outcome``, default the
    sample's) on its last loss token."""
    if r.sample.token_rewards is not None:
        return r.sample.token_rewards
    out = np.zeros(r.sample.num_tokens)
    live = np.flatnonzero(r.sample.loss_mask)
    if live.size:
        out[live[-1]] = r.sample.reward if outcome is None else outcome
    return out


def _critic_rewards(r: _Row) -> np.ndarray:
    """What the learner's GAE sees (algo.critic): the per-token rewards of a trained row (with the
    soft overlong penalty on its last policy token), 0 on a row left out of the loss."""
    mask = _response_mask(r)
    if not mask.any():
        return np.zeros(r.sample.num_tokens)
    out = _token_rewards(r, r.reward).astype(np.float64)
    if r.sample.token_rewards is not None and r.reward != r.sample.reward:
        out[np.flatnonzero(mask)[-1]] += r.reward - r.sample.reward
    return out * (mask > 0)


def _outcome_advantages(rows: list[_Row], algo: AlgoConfig) -> list[np.ndarray]:
    """Per-row response-aligned advantages (0 on excluded rows), non-step-wise."""
    if algo.advantage_estimator == "gae":  # the learner computes them with its critic (token_rewards)
        return [np.zeros(r.sample.num_tokens, dtype=np.float32) for r in rows]
    estimator = get_advantage_estimator(algo.advantage_estimator)
    valid = [r for r in rows if r.valid]
    out = [np.zeros(r.sample.num_tokens, dtype=np.float32) for r in rows]
    if not valid:
        return out
    mask = _padded([_response_mask(r) for r in valid])
    token_rewards = None
    if any(r.sample.token_rewards is not None for r in valid):
        token_rewards = _padded([_token_rewards(r) for r in valid])
    adv = estimator(
        torch.tensor([r.reward for r in valid], dtype=torch.float64),
        torch.tensor([r.group_index for r in valid], dtype=torch.long),
        mask,
        params=_advantage_params(algo),
        token_rewards=token_rewards,
    )
    it = iter(adv)
    for k, r in enumerate(rows):
        if r.valid:
            out[k] = next(it)[: r.sample.num_tokens].numpy().astype(np.float32)
    return out


def _stepwise_advantages(rows: list[_Row], algo: AlgoConfig) -> list[np.ndarray]:
    """One scalar per trajectory (its last step's reward), broadcast on each step's own mask."""
    estimator = get_advantage_estimator(algo.advantage_estimator)
    trajs: dict[tuple[int, int], list[int]] = {}
    for k, r in enumerate(rows):
        trajs.setdefault((r.group_index, r.sample.trajectory_id), []).append(k)
    keys = list(trajs)
    last = [max(trajs[key], key=lambda k: rows[k].sample.step_index) for key in keys]
    # A trajectory whose final reward failed is excluded as a whole.
    valid_t = [i for i, k in enumerate(last) if rows[k].valid]
    valid_set = set(valid_t)
    traj_adv = torch.zeros(len(keys), dtype=torch.float64)
    if valid_t:
        rewards = torch.tensor([rows[last[i]].reward for i in valid_t], dtype=torch.float64)
        gids = torch.tensor([keys[i][0] for i in valid_t], dtype=torch.long)
        ones = torch.ones(len(valid_t), 1, dtype=torch.float64)
        traj_adv[valid_t] = estimator(rewards, gids, ones, params=_advantage_params(algo))[:, 0]
    traj_of_row = torch.zeros(len(rows), dtype=torch.long)
    for t, key in enumerate(keys):
        for k in trajs[key]:
            traj_of_row[k] = t
            # Earlier steps' own rewards are ignored (they may be NaN placeholders).
            rows[k].valid = t in valid_set
    masks = _padded([_response_mask(r) for r in rows])
    adv = broadcast_trajectory_advantages(traj_adv, traj_of_row, masks)
    return [adv[k, : r.sample.num_tokens].numpy().astype(np.float32) for k, r in enumerate(rows)]


def _add_teacher(rows: list[_Row], advs: list[np.ndarray], teacher: TeacherConfig) -> dict[str, float]:
    """Add the teacher's term to each trained row's advantages (in place); its metrics. A row
    that would be trained without teacher log-probs (the run's contract lets none through but
    an earlier step of a step-wise trajectory whose own reward is NaN) is left out of the loss
    instead: trained, it would be plain RL."""
    missing = [r for r in rows if _response_mask(r).any() and r.sample.teacher_logprobs is None]
    for r in missing:
        r.valid = False
    live = [k for k, r in enumerate(rows) if _response_mask(r).any()]
    if not live:
        return {"teacher/missing_samples": float(len(missing))}
    mask = _padded([_response_mask(rows[k]) for k in live])
    behaviour = _padded([rows[k].sample.rollout_logprobs for k in live])
    teacher_logp = _padded([rows[k].sample.teacher_logprobs for k in live])  # type: ignore[misc]
    term = teacher_advantages(behaviour, teacher_logp, mask, coef=teacher.coef, discount=teacher.discount)
    for j, k in enumerate(live):
        advs[k] = (advs[k] + term[j, : rows[k].sample.num_tokens].numpy()).astype(np.float32)
    kl = reverse_kl_per_token(behaviour, teacher_logp, mask)
    return {
        "teacher/missing_samples": float(len(missing)),
        "teacher/kl_mean": float(kl.sum() / mask.sum()),
        "teacher/kl_seq_mean": float(kl.sum(dim=1).mean()),
        "teacher/adv_abs_mean": float(term.abs().sum() / mask.sum()),
    }


def _sequence_fields(r: _Row, adv: np.ndarray) -> dict[str, torch.Tensor]:
    """Full-length (prompt + response) fields of one row, aligned to input_ids."""
    s, p = r.sample, r.prompt.shape[0]
    versions = s.token_versions if s.token_versions is not None else np.full(s.num_tokens, s.behavior_version)
    pad = np.zeros(p)
    return {
        "input_ids": torch.as_tensor(np.concatenate([r.prompt, s.response_ids]).astype(np.int64)),
        "loss_mask": torch.as_tensor(np.concatenate([pad, _response_mask(r)])),
        "rollout_logprobs": torch.as_tensor(np.concatenate([pad, s.rollout_logprobs.astype(np.float64)])),
        "advantages": torch.as_tensor(np.concatenate([pad, adv.astype(np.float64)])),
        "token_versions": torch.as_tensor(np.concatenate([np.full(p, s.behavior_version), versions]).astype(np.int64)),
    }


def _merge_steps(rows: list[_Row], fields: list[dict]) -> tuple[list[dict], list[list[int]]]:
    """Merge prefix-sharing consecutive steps within each trajectory (in step order)."""
    by_traj: dict[tuple[int, int], list[int]] = {}
    for k, r in enumerate(rows):
        by_traj.setdefault((r.group_index, r.sample.trajectory_id), []).append(k)
    out_fields, out_rows = [], []
    for ks in by_traj.values():
        ks = sorted(ks, key=lambda k: rows[k].sample.step_index)
        merged, sources = merge_prefix_steps([fields[k] for k in ks])
        out_fields += merged
        out_rows += [[ks[i] for i in src] for src in sources]
    return out_fields, out_rows


def build_minibatches(
    groups: list[RolloutGroup],
    algo: AlgoConfig,
    *,
    num_minibatches: int,
    pad_token_id: int = 0,
    max_new_tokens: int | None = None,
    teacher: TeacherConfig | None = None,
    pixels: ImagePixels | None = None,
) -> tuple[list[list[TrainSequence]], dict[str, float]]:
    """Advantages, step-wise merge, whole-group mini-batches and their reduction weights.

    Args:
        groups: the rollout groups of one trainer step.
        algo: the algo branch of the config.
        num_minibatches: optimizer steps this data is split into (whole groups each).
        pad_token_id: what a refused image prompt's image tokens become (``pixels``);
            TrainSequences are otherwise unpadded (``asyncrl.data.microbatch`` pads).
        max_new_tokens: rollout.max_tokens, the soft overlong penalty's L_max for groups that
            did not record their own budget.
        teacher: rollout.teacher: add its per-token term to the advantages (every trained
            sample must carry teacher_logprobs).
        pixels: a vision-language model's image processor and token counts: each sequence
            carries its group's pixel values (module docstring).

    Returns:
        (mini-batches, metrics) with metrics ``reward/mean``, ``reward/std`` (left out when
        no reward succeeded, rather than NaN),
        ``reward/num_failed``, ``response/length_mean``, ``response/length_max``,
        ``advantages/mean``, ``advantages/abs_mean`` (not with algo.critic), ``batch/num_sequences``,
        ``batch/num_loss_tokens``, with a teacher ``teacher/kl_mean`` (per loss token),
        ``teacher/kl_seq_mean`` (summed per sample), ``teacher/adv_abs_mean`` and
        ``teacher/missing_samples``, and, step-wise,
        ``stepwise/num_seq_before_merge`` / ``stepwise/num_seq_after_merge``.
    """
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches={num_minibatches!r}: must be >= 1")
    if len(groups) < num_minibatches:
        raise ValueError(f"{len(groups)} groups cannot fill num_minibatches={num_minibatches} (groups are never split)")
    rows = _rows(groups, algo, max_new_tokens)
    refused = _attach_pixels(rows, groups, pixels, pad_token_id) if pixels is not None else None
    advs = _stepwise_advantages(rows, algo) if algo.stepwise else _outcome_advantages(rows, algo)
    teacher_metrics = _add_teacher(rows, advs, teacher) if teacher is not None else {}
    fields = [_sequence_fields(r, a) for r, a in zip(rows, advs, strict=True)]
    if algo.critic.enabled:
        for r, f in zip(rows, fields, strict=True):
            f["token_rewards"] = torch.as_tensor(np.concatenate([np.zeros(r.prompt.shape[0]), _critic_rewards(r)]))
    metrics = _metrics(rows, advs) | teacher_metrics
    if refused is not None:
        metrics["vision/refused_samples"] = float(refused)
    if algo.critic.enabled:  # the driver's advantages are all 0 there: the learner's critic/advantage_mean says
        metrics = {k: v for k, v in metrics.items() if not k.startswith("advantages/")}
    if algo.overlong.mask or algo.overlong.soft_penalty is not None:
        metrics |= _overlong_metrics(rows)
    if algo.stepwise and algo.merge_stepwise:
        fields, sources = _merge_steps(rows, fields)
        metrics["stepwise/num_seq_before_merge"] = float(len(rows))
        metrics["stepwise/num_seq_after_merge"] = float(len(fields))
    else:
        sources = [[k] for k in range(len(rows))]
        if algo.stepwise:
            metrics["stepwise/num_seq_before_merge"] = metrics["stepwise/num_seq_after_merge"] = float(len(rows))

    # Whole groups, contiguous, as even in group count as possible.
    bounds = np.linspace(0, len(groups), num_minibatches + 1).round().astype(int)
    minibatches: list[list[TrainSequence]] = []
    for lo, hi in pairwise(bounds):
        members = [i for i, src in enumerate(sources) if lo <= rows[src[0]].group_index < hi]
        masks = _padded([fields[i]["loss_mask"].numpy() for i in members])
        group_ids = torch.tensor([rows[sources[i][0]].group_index for i in members], dtype=torch.long)
        weights = reduction_weights(masks, algo.loss_reduction, constant=algo.reduction_constant, group_ids=group_ids)
        minibatches.append(
            [
                _train_sequence(fields[i], weights[j], [rows[k] for k in sources[i]], groups, algo)
                for j, i in enumerate(members)
            ]
        )
    metrics["batch/num_loss_tokens"] = float(sum(f["loss_mask"].sum() for f in fields))
    metrics["batch/num_sequences"] = float(len(fields))
    return minibatches, metrics


def minibatch_of(group_id: str, minibatches: list[list[TrainSequence]]) -> int:
    """The index of the mini-batch holding this group's sequences (0 if none does)."""
    for j, mb in enumerate(minibatches):
        if any(seq.group_id == group_id for seq in mb):
            return j
    return 0


def _routing(src: list[_Row], n: int, algo: AlgoConfig) -> np.ndarray | None:
    """The engine routing a sequence of n tokens replays: with algo.routing_replay='rollout',
    its (last) sample's, when that covers the whole sequence (rows n - 1). A merged step-wise
    sequence whose last step's routing does not cover it routes itself."""
    routed = src[-1].sample.routed_experts if algo.routing_replay == "rollout" else None
    return routed if routed is not None and routed.shape[0] == n - 1 else None


def _train_sequence(
    f: dict, w: torch.Tensor, src: list[_Row], groups: list[RolloutGroup], algo: AlgoConfig
) -> TrainSequence:
    n = f["input_ids"].shape[0]
    image = src[0].pixels  # a group's images: every step of a trajectory has the same
    return TrainSequence(
        input_ids=f["input_ids"].numpy().astype(np.int32),
        loss_mask=f["loss_mask"].numpy().astype(np.float32),
        rollout_logprobs=(f["rollout_logprobs"] * f["loss_mask"]).numpy().astype(np.float32),
        advantages=f["advantages"].numpy().astype(np.float32),
        reduction_weights=w[:n].numpy().astype(np.float32),
        token_versions=f["token_versions"].numpy().astype(np.int32),
        behavior_version=min(r.sample.behavior_version for r in src),
        group_id=groups[src[0].group_index].group_id,
        sample_index=src[0].sample_index,
        token_rewards=f["token_rewards"].numpy().astype(np.float32) if "token_rewards" in f else None,
        routed_experts=_routing(src, n, algo),
        pixel_values=image.pixel_values if image is not None else None,
        pixel_attention_mask=image.pixel_attention_mask if image is not None else None,
    )


def _metrics(rows: list[_Row], advs: list[np.ndarray]) -> dict[str, float]:
    rewards = np.array([r.sample.reward for r in rows if r.valid], dtype=np.float64)
    lengths = np.array([r.sample.num_tokens for r in rows], dtype=np.float64)
    masked_adv = np.concatenate(
        [a[r.sample.loss_mask > 0] for r, a in zip(rows, advs, strict=True) if r.valid] or [np.zeros(0)]
    )
    out = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std())} if rewards.size else {}
    return out | {
        "reward/num_failed": float(sum(not r.valid for r in rows)),
        "response/length_mean": float(lengths.mean()) if lengths.size else 0.0,
        "response/length_max": float(lengths.max()) if lengths.size else 0.0,
        "advantages/mean": float(masked_adv.mean()) if masked_adv.size else 0.0,
        "advantages/abs_mean": float(np.abs(masked_adv).mean()) if masked_adv.size else 0.0,
    }


def _overlong_metrics(rows: list[_Row]) -> dict[str, float]:
    valid = [r for r in rows if r.valid]
    return {
        "overlong/truncated_frac": float(np.mean([is_truncated(r.sample.stop_reason) for r in rows])),
        "overlong/masked_samples": float(sum(r.overlong_masked for r in rows)),
        "overlong/penalty_mean": float(np.mean([r.reward - r.sample.reward for r in valid])) if valid else 0.0,
    }
