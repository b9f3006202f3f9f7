"""The parity gate: before a run's first optimizer update, and a resumed run's, the learner
scores the tokens the engines sampled with the learner's own current weights and must agree
with the engines' log-probs.

    gate = ParityGate(cfg, model_path)                    # control.parity_gate: stop | warn | off
    gate.pending                                          # True until the first batch was checked
    result = gate.check(learner, sequences, version)      # GateResult, or None: no staleness-0 token
    gate.enforce(result)                                  # ParityMismatch (stop) or a warning (warn)
    metrics.update(result.metrics())                      # parity/gate_* in that step's row

Staleness 0 means the same weights on both sides, so any gap beyond float error says the
learner scores a different distribution than the one that sampled: an attention rule its
kernel ignores (soft-capping, sliding windows), a model config the engine was given and the
learner was not, a sampling rule the learner does not apply, another dtype or quantisation,
or a weight the engine's loader maps to another parameter. A run in that state trains on a
wrong importance ratio from its first step and looks healthy for days; the gate says so
before the first update, with the size of the gap and the likely causes.

Only tokens labelled with the learner's current version count (the loop asks the queue for
nothing older for this one batch), and only loss tokens: observation tokens were never
sampled. A token the engine sampled that the learner's top-k / top-p cut leaves out (log-prob
-inf) is counted apart; a few can sit on the cut's boundary through float error, more than
OUTSIDE_FRAC of the tokens cannot.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.infra import ExpectedFailure

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.learner import LearnerGroup
    from asyncrl.types import TrainSequence

log = logging.getLogger(__name__)

TOLERANCES: dict[str, float] = {
    # Both sides in float32 (every CPU run): only summation order differs, ~1e-6 measured.
    "float32": 1e-3,
    # bfloat16 on both sides, rounded at other points (fused kernels against FSDP's compute):
    # log-probs agree to ~1e-2, the odd low-probability token further.
    "bfloat16": 1e-1,
    "float16": 3e-2,
}
"""Default control.parity_tolerance by the dtype both sides compute in (the parity suite's
max |diff| bounds)."""
OUTSIDE_FRAC = 0.01
MAX_SEQUENCES = 64
MAX_NAMED = 5
"""Group ids a gate line names at most."""
"""The gate scores at most this many sequences of its batch: one forward, once per start."""


class ParityMismatch(RuntimeError, ExpectedFailure):
    """The learner's log-probs differ from the engine's at staleness 0 (control.parity_gate=stop)."""


@dataclass(frozen=True)
class GateResult:
    version: int
    sequences: int
    tokens: int
    max_abs_diff: float
    """Largest |learner - engine| log-prob over the compared tokens (inf: none could be compared)."""
    mean_abs_diff: float
    outside: int
    """Sampled tokens the learner gives probability 0 (outside its top-k / top-p cut)."""
    tolerance: float
    dtype: str
    mode: str
    groups: int = 1
    """Groups compared."""
    disagreeing: tuple[str, ...] = ()
    """Ids of the groups that on their own are outside the tolerance."""

    @property
    def passed(self) -> bool:
        """A mismatch of the learner against the engines shows in (nearly) every group; one in a
        minority of groups is their records' (a writer with the queue's credentials, an elastic
        generator set up differently), named by ``line`` and not a reason to stop the run."""
        return self.within if not self.disagreeing else 2 * len(self.disagreeing) < self.groups

    @property
    def within(self) -> bool:  # NaN compares false: never within
        return self.max_abs_diff <= self.tolerance and self.outside <= OUTSIDE_FRAC * max(self.tokens, 1)

    def metrics(self) -> dict[str, float]:
        """parity/gate_* for the metrics row of the step it gated."""
        return {
            "parity/gate_max_abs_diff": self.max_abs_diff,
            "parity/gate_mean_abs_diff": self.mean_abs_diff,
            "parity/gate_tolerance": self.tolerance,
            "parity/gate_tokens": float(self.tokens),
            "parity/gate_passed": float(self.passed),
        }

    def record(self) -> dict[str, Any]:
        """What summary.json and the run's state hash keep (JSON)."""
        return {**asdict(self), "passed": self.passed}

    def line(self) -> str:
        """The console's one line."""
        outside = f", {self.outside} sampled token(s) outside the learner's top-k/top-p cut" if self.outside else ""
        odd = ""
        if self.disagreeing:
            shown = ", ".join(self.disagreeing[:MAX_NAMED])
            odd = f"; {len(self.disagreeing)} of {self.groups} groups disagree on their own ({shown})"
        return (
            f"parity gate {'passed' if self.passed else 'FAILED'} at v{self.version}: learner vs engine "
            f"log-probs on {self.tokens} tokens of {self.sequences} samples: max |diff| {self.max_abs_diff:.3g} "
            f"(mean {self.mean_abs_diff:.3g}; tolerance {self.tolerance:g}, {self.dtype}){outside}{odd}"
        )


def compare(
    learner_logprobs: list[np.ndarray], sequences: list[TrainSequence], version: int
) -> tuple[int, int, float, float, int]:
    """(sequences, tokens, max |diff|, mean |diff|, outside) over each sequence's loss tokens
    labelled ``version``; learner_logprobs[i] is aligned to sequences[i].input_ids."""
    diffs: list[np.ndarray] = []
    outside = used = 0
    for lp, seq in zip(learner_logprobs, sequences, strict=True):
        keep = (np.asarray(seq.loss_mask) > 0) & (np.asarray(seq.token_versions) == version)
        if not keep.any():
            continue
        used += 1
        mine = np.asarray(lp, dtype=np.float64)[keep]
        theirs = np.asarray(seq.rollout_logprobs, dtype=np.float64)[keep]
        cut = np.isneginf(mine)  # probability 0 under the learner's cut (a NaN stays in, and fails)
        outside += int(cut.sum())
        diffs.append(np.abs(mine[~cut] - theirs[~cut]))
    flat = np.concatenate(diffs) if diffs else np.zeros(0)
    if flat.size == 0:
        return used, outside, math.inf, math.inf, outside
    worst = float(np.nan) if np.isnan(flat).any() else float(flat.max())
    return used, int(flat.size) + outside, worst, float(flat.mean()), outside


def at_version(sequences: list[TrainSequence], version: int) -> list[TrainSequence]:
    """The sequences with a loss token sampled at ``version`` (staleness 0), at most MAX_SEQUENCES."""
    out = [s for s in sequences if ((np.asarray(s.loss_mask) > 0) & (np.asarray(s.token_versions) == version)).any()]
    return out[:MAX_SEQUENCES]


def compute_dtype(cfg: Config, learner_device: str) -> str:
    """The dtype both sides compute in: the learner's on CUDA, float32 on CPU (where the learner
    always computes float32, and so does the engine), unless the engine was given its own
    (rollout.engine_kwargs.dtype): then the coarser of the two."""
    learner = cfg.learner.dtype if learner_device.startswith("cuda") else "float32"
    engine = str(cfg.rollout.engine_kwargs.get("dtype", learner)).replace("torch.", "")
    if engine not in TOLERANCES:
        return learner
    return max(learner, engine, key=lambda d: TOLERANCES[d])


def likely_causes(cfg: Config, model_path: str) -> list[str]:
    """What in this run can make the two sides disagree, most specific first; then the causes
    no setting shows."""
    causes: list[str] = []
    hf = _hf_config(model_path)
    features = [
        f"{k}={hf[k]}"
        for k in ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "logits_scaling")
        if hf.get(k) is not None
    ]
    if features:
        causes.append(
            f"the model's config sets {', '.join(features)}: an attention or logit rule the learner's "
            "attention implementation or kernels may not apply"
        )
    kwargs = cfg.rollout.engine_kwargs
    for key, why in (
        ("hf_overrides", "changes the engine's model config, which the learner does not read"),
        ("dtype", "makes the engine compute in another dtype than the learner"),
        ("quantization", "quantises the engine's weights; the learner's are not"),
        ("kv_cache_dtype", "stores the engine's KV cache in another dtype"),
        ("tokenizer", "gives the engine another tokenizer than the learner's model"),
        ("revision", "loads another revision of the model in the engine"),
        ("generation_config", "lets the engine apply the model's generation config"),
        ("logits_processors", "changes the engine's logits in a way the learner does not know"),
    ):
        if key in kwargs:
            causes.append(f"rollout.engine_kwargs.{key}={kwargs[key]!r} {why}")
    if cfg.rollout.top_k > 0 or cfg.rollout.top_p < 1:
        causes.append(
            f"sampling with top_k={cfg.rollout.top_k}, top_p={cfg.rollout.top_p}: the learner applies the "
            "same cut, but a token on its boundary can fall on either side"
        )
    causes += [
        "a weight the engine's loader maps to another parameter than the learner's (a renamed, tied "
        "or fused weight), or one it skips",
        "a different tokenizer or chat template on the two sides (the learner scores the engine's token ids as given)",
        "a sampling rule the engine applies and the learner does not (penalties, logit bias, min_p)",
    ]
    return causes


def _hf_config(model_path: str) -> dict[str, Any]:
    try:
        data = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    text = data.get("text_config")  # multimodal wrappers keep the decoder's settings here
    return {**data, **text} if isinstance(text, dict) else data


class ParityGate:
    """Checks one batch per start; see the module docstring."""

    def __init__(self, cfg: Config, model_path: str):
        self.cfg = cfg
        self.model_path = model_path
        self.mode = cfg.control.parity_gate
        self.result: GateResult | None = None
        self.pending = self.mode != "off" and cfg.rollout.logprobs
        if self.mode != "off" and not cfg.rollout.logprobs:
            log.warning("parity gate skipped: rollout.logprobs=false, the engines record no log-probs to compare")

    def tolerance(self, learner_device: str) -> tuple[float, str]:
        dtype = compute_dtype(self.cfg, learner_device)
        tol = self.cfg.control.parity_tolerance
        return (TOLERANCES.get(dtype, TOLERANCES["bfloat16"]) if tol is None else tol), dtype

    def check(self, learner: LearnerGroup, sequences: list[TrainSequence], version: int) -> GateResult | None:
        """Score the batch's staleness-0 sequences (None, still pending, if it has none); a pass
        is logged here, a failure is for ``enforce``."""
        chosen = at_version(sequences, version)
        if not chosen:
            return None
        logprobs = learner.compute_logprobs(chosen, self.cfg.rollout.temperature)
        used, tokens, worst, mean, outside = compare(logprobs, chosen, version)
        tol, dtype = self.tolerance(str(learner.rank_info[0].get("device", "cpu")))
        by_group: dict[str, list[int]] = {}
        for i, seq in enumerate(chosen):
            by_group.setdefault(seq.group_id, []).append(i)
        disagreeing = []
        for gid, idx in by_group.items():
            _, g_tokens, g_worst, g_mean, g_outside = compare(
                [logprobs[i] for i in idx], [chosen[i] for i in idx], version
            )
            if not GateResult(version, len(idx), g_tokens, g_worst, g_mean, g_outside, tol, dtype, self.mode).within:
                disagreeing.append(gid[:80])
        result = GateResult(
            version, used, tokens, worst, mean, outside, tol, dtype, self.mode, len(by_group), tuple(disagreeing)
        )
        self.result, self.pending = result, False
        if result.passed and result.disagreeing:
            log.warning("%s: their records disagree with this run's engines; training goes on", result.line())
        elif result.passed:
            log.info("%s", result.line())
        return result

    def enforce(self, result: GateResult) -> None:
        """A failed gate: ParityMismatch in stop mode, a warning in warn mode."""
        if result.passed:
            return
        causes = "; ".join(f"({i}) {c}" for i, c in enumerate(likely_causes(self.cfg, self.model_path), 1))
        message = (
            f"{result.line()}. The engine sampled these tokens with the learner's own weights, so they must "
            f"agree: the learner would train another policy than the one that samples. Likely causes: {causes}"
        )
        if self.mode == "stop":
            raise ParityMismatch(
                f"{message}. Stopped before any update (control.parity_gate=stop; warn trains anyway, "
                "control.parity_tolerance sets the bound)"
            )
        log.warning("%s. Training anyway (control.parity_gate=warn)", message)
