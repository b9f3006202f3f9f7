"""Log-prob parity of a run trained at ``learner.lr=0``: the learner's log-probs against the engine's.

At lr = 0 the policy never moves, so for every trained token the learner's log-prob (the
proximal "old" one and the training forward's) must equal the log-prob the engine recorded
while sampling, up to float error. Anything else means the learner scores a different
distribution than the one that sampled (a sampling option it ignores, a prompt the engine
never saw, dropout, a stale weight file...), and every correction built on the ratio
exp(old - rollout) then trains the wrong thing.

    cfg = load_config("configs/demo.yaml", [*PARITY_OVERRIDES, ...])
    train(cfg)
    result = parity_of_run("A", run_dir, covers="top_p 0.9, ...", dtype=cfg.learner.dtype)
    assert result.ok, result.why()

The numbers come from the ``drift/*`` metrics the learner logs every step (metrics.jsonl):
``drift/logprob_abs_diff_max`` when the learner reports it, else the largest |log| of the
uncapped TIS ratio's max and min, ``drift/abs_logp_diff`` (mean |diff| over the step's
loss tokens) and the masks' ``drift/masked_frac``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PARITY_OVERRIDES: tuple[str, ...] = (
    "learner.lr=0",
    # Token TIS with a cap no ratio reaches, so the uncapped ratio's extremes are logged and a
    # capped token would show a mismatch, plus two masks that must never fire at parity.
    "algo.correction.tis=token",
    "algo.correction.tis_cap=1000",
    "algo.correction.geo_mask=true",
    "algo.correction.geo_mask_low=0.99",
    "algo.correction.geo_mask_high=1.01",
    "algo.correction.token_mask_low=0.99",
    "algo.correction.token_mask_high=1.01",
)
"""What every parity run sets on top of its variant's own options."""


@dataclass(frozen=True)
class Tolerance:
    """Largest allowed |learner log-prob - engine log-prob|: any one token, and a step's mean."""

    max_abs: float
    mean_abs: float


TOLERANCES: dict[str, Tolerance] = {
    # Both sides compute in float32 (every CPU run: the learner and the engine are float32 there
    # whatever learner.dtype says); what is left is summation order in different kernels,
    # measured at ~1e-6.
    "float32": Tolerance(max_abs=1e-3, mean_abs=1e-4),
    # A CUDA run with learner.dtype=bfloat16: the engine computes in bfloat16 too, but rounds
    # at other points than the learner (fused vLLM kernels and CUDA graphs against FSDP's bf16
    # compute of fp32 master weights): 8 mantissa bits, a relative 4e-3 per rounding, add up
    # over the layers to log-probs that agree only to ~1e-2 (the mismatch the literature on
    # train/inference precision reports), with the odd low-probability token further off.
    "bfloat16": Tolerance(max_abs=1e-1, mean_abs=1e-2),
    # float16 (an engine_kwargs dtype override): 11 mantissa bits, 8x finer than bfloat16, but
    # each side still rounds at its own points.
    "float16": Tolerance(max_abs=3e-2, mean_abs=3e-3),
}
"""Keyed by the run's compute dtype (``run_dtype``)."""


def run_dtype(learner_dtype: str, platform: str) -> str:
    """The dtype both sides of a run compute in, which picks its tolerance: the engine's, which
    follows the learner's (asyncrl.rollout.sampling.engine_dtype): ``learner.dtype`` on CUDA,
    float32 on the CPU."""
    from asyncrl.rollout.sampling import engine_dtype

    return engine_dtype(learner_dtype, platform)


@dataclass(frozen=True)
class ParityResult:
    """One variant's parity over all its logged steps (the worst step decides)."""

    variant: str
    covers: str
    dtype: str
    steps: int
    max_abs_diff: float
    """Largest |learner - engine| log-prob of any trained token."""
    mean_abs_diff: float
    """Largest per-step mean |diff| over the step's trained tokens."""
    masked_frac: float
    """Largest fraction of a step's tokens any correction mask removed (must be 0)."""
    tis_capped_frac: float
    rollout_kl: float
    """Largest per-step k3 estimate of KL(rollout || learner)."""
    max_from: str
    """Where max_abs_diff was read: 'logprob_abs_diff_max' or 'tis_ratio' (max |log ratio|)."""
    problems: tuple[str, ...] = field(default=())

    @property
    def tolerance(self) -> Tolerance:
        return TOLERANCES[self.dtype]

    @property
    def ok(self) -> bool:
        return not self.problems

    def why(self, most: int = 12) -> str:
        shown = list(self.problems[:most])
        if len(self.problems) > most:
            shown.append(f"... and {len(self.problems) - most} more")
        return f"variant {self.variant} ({self.covers}) is not at parity:\n  " + "\n  ".join(shown)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "tolerance": asdict(self.tolerance)}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every row of run_dir/metrics.jsonl (a resumed run's repeated steps included)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(row: dict[str, Any], name: str) -> float | None:
    value = row.get(name)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def parity_of_rows(
    variant: str, rows: list[dict[str, Any]], *, covers: str = "", dtype: str = "float32"
) -> ParityResult:
    """Check the parity rules on a run's metric rows: every step logged its drift metrics,
    max |diff| and every step's mean |diff| are within ``TOLERANCES[dtype]``, no mask fired
    and no TIS weight was capped."""
    tol = TOLERANCES[dtype]
    problems: list[str] = []
    worst = {"max": 0.0, "mean": 0.0, "masked": 0.0, "capped": 0.0, "kl": 0.0}
    sources = set()
    if not rows:
        problems.append("no step was logged")
    for row in rows:
        step = row.get("step")
        direct = _finite(row, "drift/logprob_abs_diff_max")
        hi, lo = _finite(row, "drift/tis_ratio_max"), _finite(row, "drift/tis_ratio_min")
        mean = _finite(row, "drift/abs_logp_diff")
        if direct is not None:
            step_max = direct
            sources.add("logprob_abs_diff_max")
        elif hi is not None and lo is not None and hi > 0 and lo > 0:
            step_max = max(abs(math.log(hi)), abs(math.log(lo)))
            sources.add("tis_ratio")
        else:
            problems.append(f"step {step}: no drift/logprob_abs_diff_max nor drift/tis_ratio_max/min logged")
            continue
        if mean is None:
            problems.append(f"step {step}: no drift/abs_logp_diff logged (are rollout logprobs recorded?)")
            continue
        masked = _finite(row, "drift/masked_frac")
        capped = _finite(row, "drift/tis_capped_frac")
        if masked is None or capped is None:
            problems.append(f"step {step}: drift/masked_frac or drift/tis_capped_frac missing (correction off?)")
            continue
        kl = _finite(row, "drift/rollout_kl") or 0.0
        if step_max > worst["max"]:
            worst["max"] = step_max
        for key, value in (("mean", mean), ("masked", masked), ("capped", capped), ("kl", kl)):
            worst[key] = max(worst[key], value)
        if step_max >= tol.max_abs:
            problems.append(f"step {step}: max |diff| {step_max:.3g} >= {tol.max_abs:g} ({dtype})")
        if mean >= tol.mean_abs:
            problems.append(f"step {step}: mean |diff| {mean:.3g} >= {tol.mean_abs:g} ({dtype})")
        if masked > 0:
            problems.append(f"step {step}: masks removed {masked:.3g} of the tokens (must be 0 at parity)")
        if capped > 0:
            problems.append(f"step {step}: {capped:.3g} of the TIS weights were capped (must be 0 at parity)")
    return ParityResult(
        variant=variant,
        covers=covers,
        dtype=dtype,
        steps=len(rows),
        max_abs_diff=worst["max"],
        mean_abs_diff=worst["mean"],
        masked_frac=worst["masked"],
        tis_capped_frac=worst["capped"],
        rollout_kl=worst["kl"],
        max_from="+".join(sorted(sources)) or "-",
        problems=tuple(problems),
    )


def parity_of_run(variant: str, run_dir: str | Path, *, covers: str = "", dtype: str = "float32") -> ParityResult:
    """``parity_of_rows`` over run_dir/metrics.jsonl."""
    return parity_of_rows(variant, read_metrics(run_dir), covers=covers, dtype=dtype)


def format_table(results: list[ParityResult]) -> str:
    """One line per variant: max and mean |diff|, masked and capped fractions, pass/fail."""
    head = (
        f"{'variant':<10} {'steps':>5} {'max|diff|':>10} {'mean|diff|':>10} {'masked':>7} {'capped':>7} "
        f"{'kl':>9}  result  covers"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        verdict = "pass" if r.ok else "FAIL"
        lines.append(
            f"{r.variant:<10} {r.steps:>5} {r.max_abs_diff:>10.3g} {r.mean_abs_diff:>10.3g} {r.masked_frac:>7.3g} "
            f"{r.tis_capped_frac:>7.3g} {r.rollout_kl:>9.3g}  {verdict:<6}  {r.covers}"
        )
    tol = TOLERANCES["float32"]
    lines.append(
        f"(float32 tolerance: max |diff| < {tol.max_abs:g}, every step's mean |diff| < {tol.mean_abs:g}, "
        "no mask fires, no TIS weight capped)"
    )
    return "\n".join(lines)


def gate_problems(rows: list[dict[str, Any]], starts: int, *, dtype: str = "float32") -> list[str]:
    """The parity gate (asyncrl.control.parity_gate) on a run's rows: it ran once per start
    (``starts``: 2 for a run resumed once), each time in the row of the start's first step,
    passed, compared tokens, and its max |diff| is within the suite's own tolerance."""
    tol = TOLERANCES[dtype]
    gated = [r for r in rows if r.get("parity/gate_max_abs_diff") is not None]
    problems = [] if len(gated) == starts else [f"the gate ran {len(gated)} times, not once per start ({starts})"]
    for r in gated:
        worst, step = r["parity/gate_max_abs_diff"], r.get("step")
        if r.get("parity/gate_passed") != 1 or not worst < tol.max_abs or not r.get("parity/gate_tokens"):
            problems.append(f"step {step}: gate max |diff| {worst:.3g}, passed {r.get('parity/gate_passed')}")
    return problems
