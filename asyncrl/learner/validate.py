"""Driver-side checks of a batch before any rank sees it.

    validate_minibatches(minibatches, cfg.algo, max_positions=512, vocab_size=64)

An exception raised on one rank in the middle of a forward/backward leaves the other ranks
waiting in a collective: on NCCL that is a traceback-less abort of every rank, on gloo a
hang until the collective timeout (the bug of SkyRL PR #1811). Everything that can be
checked from the data alone is therefore checked here, on the driver, and fails with a
ValueError that names the field and the sequence (mini-batch j, sequence i, group id).
"""

from __future__ import annotations

import numpy as np

from asyncrl.config import AlgoConfig
from asyncrl.data.contract import LOGPROB_TOLERANCE
from asyncrl.data.pixels import ImagePixels
from asyncrl.types import TrainSequence

PER_TOKEN_FIELDS = ("loss_mask", "rollout_logprobs", "advantages", "reduction_weights", "token_versions")


def _where(j: int, i: int, seq: TrainSequence) -> str:
    return f"mini-batch {j}, sequence {i} (group_id={seq.group_id!r}, sample_index={seq.sample_index})"


def _check_sequence(
    j: int, i: int, seq: TrainSequence, algo: AlgoConfig, max_positions: int, vocab_size: int | None
) -> None:
    if not isinstance(seq, TrainSequence):
        raise ValueError(f"mini-batch {j}, sequence {i}: expected a TrainSequence, got {type(seq).__name__}")
    where = _where(j, i, seq)
    ids = np.asarray(seq.input_ids) if seq.input_ids is not None else None
    if ids is None or ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"{where}: input_ids must be a non-empty 1-D array")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{where}: input_ids must be integers, got dtype {ids.dtype}")
    if ids.size > max_positions:
        raise ValueError(f"{where}: {ids.size} tokens exceed the model's max_position_embeddings={max_positions}")
    if vocab_size is not None and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{where}: input_ids outside [0, {vocab_size}) (min {ids.min()}, max {ids.max()})")
    for name in PER_TOKEN_FIELDS:
        value = getattr(seq, name, None)
        if value is None:
            raise ValueError(f"{where}: field {name!r} is missing (None)")
        arr = np.asarray(value)
        if arr.shape != ids.shape:
            raise ValueError(f"{where}: field {name!r} has shape {arr.shape}, input_ids has {ids.shape}")
    if algo.critic.enabled:
        # The critic's GAE reads the per-token rewards; without them it would train on zeros.
        rewards = getattr(seq, "token_rewards", None)
        if rewards is None or np.asarray(rewards).shape != ids.shape:
            got = "missing" if rewards is None else f"shape {np.asarray(rewards).shape}"
            raise ValueError(f"{where}: field 'token_rewards' is {got}; algo.critic needs it as input_ids {ids.shape}")
        if not np.isfinite(np.asarray(rewards, dtype=np.float64)).all():
            raise ValueError(f"{where}: field 'token_rewards' has NaN/inf")
    mask = np.asarray(seq.loss_mask, dtype=np.float64)
    for name in ("loss_mask", "advantages", "reduction_weights"):
        arr = np.asarray(getattr(seq, name), dtype=np.float64)
        if not np.isfinite(arr).all():
            raise ValueError(
                f"{where}: field {name!r} has NaN/inf at positions {np.flatnonzero(~np.isfinite(arr))[:8].tolist()}"
            )
    if (np.asarray(seq.reduction_weights) < 0).any():
        raise ValueError(f"{where}: field 'reduction_weights' has negative entries")
    if algo.needs_rollout_logprobs:
        # Needed on every trained token by the rollout-KL term, every off-policy correction and the
        # losses whose ratio is to the rollout policy (rollout_is, dppo, cispo_anchor=rollout).
        rollout = np.asarray(seq.rollout_logprobs, dtype=np.float64)
        bad = (mask > 0) & ~(np.isfinite(rollout) & (rollout <= LOGPROB_TOLERANCE))
        if bad.any():
            raise ValueError(
                f"{where}: field 'rollout_logprobs' is NaN/inf/positive on trained positions "
                f"{np.flatnonzero(bad)[:8].tolist()}; the configured loss needs it "
                f"(algo.rollout_kl_coef={algo.rollout_kl_coef}, algo.correction enabled={algo.correction.enabled}, "
                f"algo.policy_loss={algo.policy_loss.type!r}, rollout-anchored={algo.rollout_anchored}). "
                f"Did the engine run with rollout.logprobs=true?"
            )


def _check_images(where: str, seq: TrainSequence, pixels: ImagePixels | None) -> None:
    """A sequence's tiles against its image tokens (asyncrl.data.pixels): the forward places one
    tile's features at each run of image tokens, and fails inside the collective otherwise."""
    values = seq.pixel_values
    if pixels is None:
        if values is not None:
            raise ValueError(f"{where}: carries images, and the model has no vision tower")
        return
    s = pixels.image_size
    tiles = 0 if values is None else int(np.asarray(values).shape[0])
    if values is not None:
        mask = seq.pixel_attention_mask
        if np.asarray(values).shape[1:] != (3, s, s) or mask is None or np.asarray(mask).shape != (tiles, s, s):
            got = None if mask is None else np.asarray(mask).shape
            raise ValueError(
                f"{where}: pixel_values {np.asarray(values).shape} / mask {got}: expected [tiles, 3, {s}, {s}]"
            )
    tokens = int((np.asarray(seq.input_ids) == pixels.image_token_id).sum())
    if tokens != tiles * pixels.image_seq_len:
        raise ValueError(f"{where}: {tokens} image tokens for {tiles} tiles x {pixels.image_seq_len}")


def validate_minibatches(
    minibatches: list[list[TrainSequence]],
    algo: AlgoConfig,
    *,
    max_positions: int,
    vocab_size: int | None = None,
    pixels: ImagePixels | None = None,
) -> None:
    """Raise ValueError naming the field and sequence of the first problem; return None if fine.
    `pixels`: the model's image token counts (a vision-language model), checked against each
    sequence's tiles."""
    if not isinstance(minibatches, (list, tuple)) or not minibatches:
        raise ValueError("train_step needs a non-empty list of mini-batches (each a list of TrainSequence)")
    for j, mb in enumerate(minibatches):
        if not isinstance(mb, (list, tuple)):
            raise ValueError(f"mini-batch {j}: expected a list of TrainSequence, got {type(mb).__name__}")
        if not mb:
            raise ValueError(f"mini-batch {j} is empty: every mini-batch needs at least one sequence")
        for i, seq in enumerate(mb):
            _check_sequence(j, i, seq, algo, max_positions, vocab_size)
            _check_images(_where(j, i, seq), seq, pixels)
