"""control.seed drives every part of a run; rollout.seed and learner.seed are offsets on it."""

from __future__ import annotations

from asyncrl.config import Config
from asyncrl.rollout.sampling import request_seed
from asyncrl.seeding import learner_seed, rollout_seed


def test_control_seed_moves_the_rollout_and_learner_seeds():
    a, b = Config(), Config()
    b.control.seed = 1
    assert rollout_seed(a) != rollout_seed(b) and learner_seed(a) != learner_seed(b)
    # ... and with them every request's sampling seed
    assert request_seed(rollout_seed(a), "gen-0.1:0") != request_seed(rollout_seed(b), "gen-0.1:0")


def test_branch_seeds_are_offsets_on_the_run_seed():
    cfg = Config()
    cfg.control.seed, cfg.rollout.seed, cfg.learner.seed = 10, 3, 5
    assert (rollout_seed(cfg), learner_seed(cfg)) == (13, 15)
    cfg.control.seed = 0  # the defaults of before: the branch seeds alone, as they were
    assert (rollout_seed(cfg), learner_seed(cfg)) == (3, 5)
