"""One seed per run: ``control.seed``. Everything random derives from it.

    rollout_seed(cfg)   prompt order, the engine's seed and every request's sampling seed
    learner_seed(cfg)   torch / numpy on the learner ranks (+ rank)
    control.seed        the tiny model's initial weights (`model: tiny`)

``rollout.seed`` and ``learner.seed`` are offsets added to it (default 0), so changing
``control.seed`` alone gives a different run in every part, as a trainer's one seed does.
What a seed reproduces in each mode is in docs/design/reproducibility.md.
"""

from __future__ import annotations

from asyncrl.config import Config


def rollout_seed(cfg: Config) -> int:
    return cfg.control.seed + cfg.rollout.seed


def learner_seed(cfg: Config) -> int:
    return cfg.control.seed + cfg.learner.seed
