"""Config rules: every bad value is rejected with a message naming the field.

.venv/bin/python -m pytest tests/unit/test_config.py -q
"""

from __future__ import annotations

import json
import logging
import re

import pytest

from asyncrl import config
from asyncrl.config import ConfigError, load_config


def rejects(overrides: list[str], *fragments: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    msg = str(err.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


def test_defaults_load():
    cfg = load_config(None, [])
    assert cfg.algo.policy_loss.type == "ppo" and cfg.algo.loss_reduction == "token_mean"


def test_gmpo_requires_sequence_mean():
    rejects(["algo.policy_loss=gmpo"], "algo.loss_reduction", "sequence_mean")
    assert (
        load_config(None, ["algo.policy_loss=gmpo", "algo.loss_reduction=sequence_mean"]).algo.policy_loss.type
        == "gmpo"
    )


def test_gmpo_rejects_token_tis_but_takes_sequence_tis():
    base = ["algo.policy_loss=gmpo", "algo.loss_reduction=sequence_mean"]
    rejects([*base, "algo.correction.tis=token"], "algo.correction.tis='token'", "gmpo")
    assert load_config(None, [*base, "algo.correction.tis=sequence"]).algo.correction.tis == "sequence"


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp"])
def test_stepwise_rejects_temporal_estimators(estimator):
    rejects(["algo.stepwise=true", f"algo.advantage_estimator={estimator}"], "algo.advantage_estimator", "stepwise")


def test_stepwise_takes_outcome_estimators():
    for est in config.OUTCOME_ESTIMATORS:
        assert load_config(None, ["algo.stepwise=true", f"algo.advantage_estimator={est}"]).algo.stepwise


def test_seq_mean_token_sum_norm_needs_its_constant():
    rejects(["algo.loss_reduction=seq_mean_token_sum_norm"], "algo.reduction_constant")
    rejects(["algo.loss_reduction=seq_mean_token_sum_norm", "algo.reduction_constant=0"], "algo.reduction_constant")
    cfg = load_config(None, ["algo.loss_reduction=seq_mean_token_sum_norm", "algo.reduction_constant=16"])
    assert cfg.algo.reduction_constant == 16.0


@pytest.mark.parametrize(
    "override, field",
    [
        ("algo.policy_loss.eps_clip_low=-0.1", "algo.policy_loss.eps_clip_low=-0.1: must be > 0"),
        ("algo.policy_loss.eps_clip_high=-0.2", "algo.policy_loss.eps_clip_high"),
        ("algo.policy_loss.eps_clip_low=1.0", "algo.policy_loss.eps_clip_low=1.0: must be < 1"),
        ("algo.policy_loss={type: dual_clip, dual_clip_c: 1.0}", "algo.policy_loss.dual_clip_c=1.0: must be > 1"),
        ("queue.outage_deadline_s=0", "queue.outage_deadline_s=0: must be > 0"),
        ("algo.lam=1.5", "algo.lam"),
        ("algo.kl_coef=-1", "algo.kl_coef"),
        ("algo.entropy_coef=-0.1", "algo.entropy_coef"),
        ("algo.correction.tis_cap=0", "algo.correction.tis_cap"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.top_k=0", "rollout.top_k"),
        ("learner.num_ranks=0", "learner.num_ranks"),
        ("queue.redis_url=http://x", "queue.redis_url"),
    ],
)
def test_out_of_range_values(override, field):
    rejects([override], field)


@pytest.mark.parametrize(
    "low, high",
    [
        ("algo.correction.geo_mask_low=1.01", "algo.correction.geo_mask_high=0.99"),
        ("algo.correction.geo_mask_low=1.0", "algo.correction.geo_mask_high=1.0"),
        ("algo.correction.product_mask_low=2.0", "algo.correction.product_mask_high=0.5"),
        ("algo.correction.outlier_low=100.0", "algo.correction.outlier_high=100.0"),
        ("algo.policy_loss={type: clip_cov, clip_cov_lb: 5.0}", "algo.policy_loss.clip_cov_ub=1.0"),
    ],
)
def test_low_must_be_below_high(low, high):
    rejects([low, high], low.split("=")[0], high.split("=")[0])


@pytest.mark.parametrize(
    "override, field",
    [
        ("algo.policy_loss=ppo2", "algo.policy_loss"),
        ("algo.advantage_estimator=ppo", "algo.advantage_estimator"),
        ("algo.kl_estimator=k5", "algo.kl_estimator"),
        ("algo.rollout_kl_estimator=k9", "algo.rollout_kl_estimator"),
        ("algo.loss_reduction=mean", "algo.loss_reduction"),
        ("algo.correction.tis=tokens", "algo.correction.tis"),
    ],
)
def test_unknown_names(override, field):
    msg = rejects([override], field)
    assert override.split("=")[1] in msg


def test_unknown_keys_name_the_path_and_the_known_fields():
    rejects(["algo.eps_clip=0.2"], "algo.eps_clip", "eps_clip_low")
    rejects(["algo.kl_coeff=0.1"], "algo.kl_coeff: unknown field", "did you mean 'kl_coef'?")
    rejects(["control.total_step=5"], "control.total_step", "did you mean 'total_steps'?")
    rejects(["algo.correction.tis_capp=2"], "algo.correction.tis_capp")
    rejects(["nosuch.x=1"], "nosuch", "algo")


@pytest.mark.parametrize(
    "override, field, expected",
    [
        ("algo.kl_coef=abc", "algo.kl_coef", "number"),
        ("algo.stepwise=maybe", "algo.stepwise", "true or false"),
        ("learner.num_ranks=1.5", "learner.num_ranks", "integer"),
        ("algo.policy_loss=[1]", "algo.policy_loss", "string"),
        ("learner.betas=[0.9]", "learner.betas", "2 values"),
        ("algo=3", "algo", "mapping"),
        ("learner.dtype=float16", "learner.dtype", "bfloat16"),
    ],
)
def test_wrong_types(override, field, expected):
    rejects([override], field, expected)


def test_rollout_kl_without_engine_logprobs_switches_them_on_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
        cfg = load_config(None, ["algo.rollout_kl_coef=0.1", "rollout.logprobs=false"])
    assert cfg.rollout.logprobs is True
    assert any("rollout.logprobs" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
        cfg = load_config(None, ["algo.correction.geo_mask=true", "rollout.logprobs=false"])
    assert cfg.rollout.logprobs is True
    assert load_config(None, ["rollout.logprobs=false"]).rollout.logprobs is False


@pytest.mark.parametrize("override", ["algo.policy_loss", "=ppo", "algo=", "algo.kl_coef.x=1"])
def test_bad_override_syntax(override):
    with pytest.raises(ConfigError, match=r"algo|override"):
        load_config(None, [override])


def test_import_path_policy_loss():
    loss = load_config(None, ["algo.policy_loss=asyncrl.algo.losses:ppo"]).algo.policy_loss
    assert (loss.type, loss.kwargs) == ("asyncrl.algo.losses:ppo", {})
    rejects(["algo.policy_loss=no_such_package.losses:fn"], "algo.policy_loss", "no_such_package.losses")
    rejects(["algo.policy_loss=:ppo"], "algo.policy_loss", "package.module:name")


def test_cross_section_rules():
    rejects(
        ["control.groups_per_step=3", "learner.mini_batches_per_step=2", "control.max_staleness=5"],
        "control.groups_per_step",
        "learner.mini_batches_per_step",
    )
    rejects(["sync.sync_every=4", "control.max_staleness=1"], "control.max_staleness")
    rejects(["rollout.max_prompt_tokens=250", "rollout.max_tokens=16"], "rollout.engine_max_model_len")
    rejects(["monitor.dashboard_host=0.0.0.0"], "monitor.dashboard_token")


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)


def test_exponent_floats_without_a_dot_are_numbers():
    # PyYAML reads '1e-5' (no dot) as a string; float fields accept it, int fields do not.
    assert load_config(None, ["learner.lr=1e-5"]).learner.lr == 1e-5
    with pytest.raises(ConfigError, match=re.escape("control.total_steps")):
        load_config(None, ["control.total_steps=1e3"])


def test_queue_outage_deadline_is_none_or_at_least_the_retry_deadline():
    assert load_config(None, []).queue.outage_deadline_s is None  # a long job waits out any outage
    assert load_config(None, ["queue.outage_deadline_s=600"]).queue.outage_deadline_s == 600.0
    with pytest.raises(ConfigError, match=r"queue.outage_deadline_s=5.0: must be >= queue.retry_deadline_s=30"):
        load_config(None, ["queue.outage_deadline_s=5"])
    assert load_config(None, ["queue.retry_deadline_s=2", "queue.outage_deadline_s=5"]).queue.outage_deadline_s == 5


def test_gae_and_the_critic_need_each_other():
    with pytest.raises(ConfigError, match=r"algo\.advantage_estimator='gae' needs a value model: set algo\.critic"):
        load_config(None, ["algo.advantage_estimator=gae"])
    with pytest.raises(ConfigError, match=r"algo\.critic\.enabled=true with algo\.advantage_estimator='grpo'"):
        load_config(None, ["algo.critic.enabled=true"])
    cfg = load_config(None, ["algo.advantage_estimator=gae", "algo.critic.enabled=true", "algo.critic.value_clip=null"])
    assert cfg.algo.critic.enabled and cfg.algo.critic.value_clip is None and cfg.algo.critic.lr == 1e-5


def test_critic_model_is_checked_at_load(tmp_path):
    gae = ["algo.advantage_estimator=gae", "algo.critic.enabled=true"]
    with pytest.raises(ConfigError, match=r"algo\.critic\.model=.*no such directory"):
        load_config(None, [*gae, f"algo.critic.model={tmp_path / 'missing'}"])
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    with pytest.raises(ConfigError, match=r"algo\.critic\.model=.*ForCausalLM or a \*ForTokenClassification"):
        load_config(None, [*gae, f"algo.critic.model={tmp_path}"])
    with pytest.raises(ConfigError, match=r"algo\.critic\.lr"):
        load_config(None, [*gae, "algo.critic.lr=0"])


def test_critic_model_must_cover_the_policy_vocabulary(tmp_path):
    """A critic with fewer embedding rows than the policy has token ids would fail at the first
    learner step (an index error; a device assert on a GPU): refused at load. A larger one (the
    same tokenizer, a padded embedding) is accepted."""
    dirs = {}
    for name, vocab in (("policy", 100), ("small", 50), ("padded", 128)):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        (dirs[name] / "config.json").write_text(
            json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab})
        )
    gae = ["algo.advantage_estimator=gae", "algo.critic.enabled=true", f"rollout.model={dirs['policy']}"]
    with pytest.raises(ConfigError, match=r"algo\.critic\.model=.*a vocabulary of 50 tokens, the policy's .* has 100"):
        load_config(None, [*gae, f"algo.critic.model={dirs['small']}"])
    assert load_config(None, [*gae, f"algo.critic.model={dirs['padded']}"]).algo.critic.model == str(dirs["padded"])


def test_critic_refuses_a_teacher(tmp_path):
    from asyncrl.rollout.tiny import write_tiny_model

    teacher = write_tiny_model(tmp_path / "teacher")
    with pytest.raises(ConfigError, match=r"algo\.critic with rollout\.teacher"):
        load_config(
            None, ["algo.advantage_estimator=gae", "algo.critic.enabled=true", f"rollout.teacher.model={teacher}"]
        )


def test_registry_keys_equal_the_config_name_tuples():
    from asyncrl.algo import ADVANTAGE_REGISTRY, KL_ESTIMATORS, LOSS_REDUCTIONS, POLICY_LOSS_REGISTRY

    assert tuple(POLICY_LOSS_REGISTRY) == config.POLICY_LOSSES
    assert all(fn.__name__ == name for name, fn in POLICY_LOSS_REGISTRY.items())
    assert tuple(ADVANTAGE_REGISTRY) == config.ADVANTAGE_ESTIMATORS
    assert tuple(KL_ESTIMATORS) == config.KL_ESTIMATORS
    assert tuple(LOSS_REDUCTIONS) == config.LOSS_REDUCTIONS
    assert set(config.OUTCOME_ESTIMATORS) <= set(ADVANTAGE_REGISTRY)


# ----------------------------------------------------------------------------- new losses, masks, guards


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "maxrl"])
def test_one_sample_per_prompt_with_a_group_baseline_is_rejected(estimator):
    rejects(
        [f"algo.advantage_estimator={estimator}", "rollout.n_samples=1"],
        "rollout.n_samples=1",
        f"algo.advantage_estimator={estimator!r}",
        "n_samples >= 2",
        "reinforce_pp",
    )
    assert load_config(None, [f"algo.advantage_estimator={estimator}", "rollout.n_samples=2"]).rollout.n_samples == 2


def test_one_sample_per_prompt_is_fine_where_advantages_do_not_need_a_group():
    assert load_config(None, ["algo.advantage_estimator=reinforce_pp", "rollout.n_samples=1"]).rollout.n_samples == 1
    assert load_config(None, ["algo.policy_loss=cross_entropy", "rollout.n_samples=1"]).rollout.n_samples == 1


def test_maxrl_warns_when_rewards_can_be_negative(caplog):
    def warned(overrides):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
            load_config(None, ["algo.advantage_estimator=maxrl", *overrides])
        return [r.getMessage() for r in caplog.records if "maxrl" in r.getMessage()]

    msgs = warned([])  # the copy env subtracts a length penalty
    assert len(msgs) == 1 and "mean reward is <= 0" in msgs[0] and "length_penalty" in msgs[0]
    assert warned(["rollout.env_kwargs={length_penalty: 0.0}"]) == []
    assert warned(["rollout.env=gsm8k", "rollout.max_prompt_tokens=192"]) == []
    assert len(warned(["rollout.env=gsm8k", "rollout.env_kwargs={format_reward: -0.5}"])) == 1
    assert len(warned(["rollout.env=countdown_chat"])) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
        load_config(None, ["algo.advantage_estimator=grpo"])
    assert not [r for r in caplog.records if "maxrl" in r.getMessage()]


def test_new_policy_losses_and_their_settings_load():
    for loss in ("importance_sampling", "rollout_is", "dppo"):
        assert load_config(None, [f"algo.policy_loss={loss}"]).algo.policy_loss.type == loss
    dppo = ["algo.policy_loss=dppo", "algo.policy_loss.dppo_mask=binary_kl", "algo.policy_loss.dppo_delta_low=0.05"]
    cfg = load_config(None, dppo)
    assert (cfg.algo.policy_loss.dppo_mask, cfg.algo.policy_loss.dppo_delta_low) == ("binary_kl", 0.05)
    rejects(["algo.policy_loss=dppo", "algo.policy_loss.dppo_mask=tv"], "algo.policy_loss.dppo_mask='tv'", "binary_tv")
    rejects(
        ["algo.policy_loss=dppo", "algo.policy_loss.dppo_delta_high=0"], "algo.policy_loss.dppo_delta_high=0", "> 0"
    )
    rejects(["algo.policy_loss={type: cispo, cispo_anchor: behaviour}"], "cispo_anchor='behaviour'", "'rollout'")
    assert load_config(None, ["algo.loss_reduction=prompt_mean"]).algo.loss_reduction == "prompt_mean"


def test_rollout_anchored_losses_need_engine_logprobs():
    for overrides in (
        ["algo.policy_loss=rollout_is"],
        ["algo.policy_loss=dppo"],
        ["algo.policy_loss=cispo", "algo.policy_loss.cispo_anchor=rollout"],
    ):
        cfg = load_config(None, [*overrides, "rollout.logprobs=false"])
        assert cfg.rollout.logprobs is True and cfg.algo.needs_rollout_logprobs
    old_anchored = load_config(None, ["algo.policy_loss=cispo", "algo.correction.tis=none"]).algo
    assert not old_anchored.needs_rollout_logprobs


def test_cispo_rollout_anchor_rejects_tis(caplog):
    base = ["algo.policy_loss=cispo", "algo.policy_loss.cispo_anchor=rollout"]
    rejects(
        [*base, "algo.correction.tis=token"],
        "algo.correction.tis='token'",
        "algo.policy_loss.cispo_anchor='rollout'",
        "tis='none'",
    )
    cfg = load_config(None, [*base, "algo.correction.token_mask_low=0.5", "algo.correction.token_mask_high=2"])
    assert cfg.algo.correction.token_mask and cfg.algo.correction.enabled
    with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
        load_config(None, ["algo.policy_loss=rollout_is", "algo.correction.tis=token"])
    assert any("already takes its ratio against the rollout policy" in r.getMessage() for r in caplog.records)


def test_token_mask_needs_both_bounds_in_order():
    rejects(["algo.correction.token_mask_low=0.5"], "algo.correction.token_mask_high=None", "both bounds")
    rejects(["algo.correction.token_mask_high=2"], "algo.correction.token_mask_low=None", "both bounds")
    rejects(
        ["algo.correction.token_mask_low=2", "algo.correction.token_mask_high=0.5"],
        "algo.correction.token_mask_low=2.0",
        "algo.correction.token_mask_high=0.5",
    )
    rejects(["algo.correction.token_mask_low=0", "algo.correction.token_mask_high=2"], "algo.correction.token_mask_low")
    assert not load_config(None, ["algo.correction.tis=none"]).algo.correction.enabled


# ----------------------------------------------------------------------------- the schema


def test_policy_loss_is_a_tagged_section_with_a_string_shorthand():
    assert load_config(None, ["algo.policy_loss=sapo"]).algo.policy_loss.sapo_tau_neg == 1.05
    cfg = load_config(None, ["algo.policy_loss={type: ppo, eps_clip_low: 0.1, eps_clip_high: 0.28}"])
    assert (cfg.algo.policy_loss.eps_clip_low, cfg.algo.policy_loss.eps_clip_high) == (0.1, 0.28)
    # A dotted override refines a loss given by name, or the default loss when none is given.
    cfg = load_config(None, ["algo.policy_loss=sapo", "algo.policy_loss.sapo_tau_pos=2"])
    assert (cfg.algo.policy_loss.type, cfg.algo.policy_loss.sapo_tau_pos) == ("sapo", 2.0)
    cfg = load_config("configs/demo.yaml", ["algo.policy_loss.eps_clip_high=0.3"])
    assert (cfg.algo.policy_loss.type, cfg.algo.policy_loss.eps_clip_high) == ("ppo", 0.3)
    rejects(["algo.policy_loss=sapp"], "algo.policy_loss='sapp'", "did you mean 'sapo'")


def test_a_flat_loss_knob_says_where_it_moved():
    rejects(["algo.eps_clip_high=0.28"], "algo.eps_clip_high", "moved into algo.policy_loss", "ppo")
    rejects(["algo.sapo_tau_pos=2"], "algo.sapo_tau_pos", "policy_loss: {type: sapo, sapo_tau_pos: ...}")


def test_a_knob_of_another_loss_names_the_loss_and_its_fields():
    rejects(
        ["algo.policy_loss=ppo", "algo.policy_loss.sapo_tau_pos=2"],
        "algo.policy_loss.sapo_tau_pos",
        "policy loss 'ppo'",
        "belongs to sapo",
        "ppo takes: eps_clip_low, eps_clip_high",
    )
    rejects(["algo.policy_loss={type: cross_entropy, eps_clip_low: 0.1}"], "cross_entropy takes no settings")
    rejects(["algo.policy_loss={type: sapo, tau: 1}"], "algo.policy_loss.tau", "unknown setting", "sapo_tau_pos")


def test_custom_losses_take_kwargs():
    cfg = load_config(None, ["algo.policy_loss={type: 'examples.custom_loss:tanh_ratio_pg', kwargs: {eps: 0.3}}"])
    assert cfg.algo.policy_loss.kwargs == {"eps": 0.3} and not cfg.algo.policy_loss.rollout_anchored
    rejects(
        ["algo.policy_loss={type: 'examples.custom_loss:tanh_ratio_pg', eps: 0.3}"],
        "algo.policy_loss.eps",
        "algo.policy_loss.kwargs",
    )


def test_the_tree_round_trips_through_to_dict():
    cfg = load_config("configs/demo.yaml", ["algo.policy_loss=dppo", "algo.policy_loss.dppo_delta_low=0.05"])
    data = cfg.to_dict()
    assert data["algo"]["policy_loss"] == {
        "type": "dppo",
        "dppo_mask": "binary_tv",
        "dppo_delta_low": 0.05,
        "dppo_delta_high": 0.2,
    }
    assert config.config_from_dict(data) == cfg


def test_prompt_source_tensorboard_and_outage_fields_have_their_defaults():
    cfg = load_config(None, [])
    assert cfg.monitor.tensorboard is False and cfg.control.eval_split == "test"
    r = cfg.rollout
    assert (r.prompt_split, r.prompt_field, r.answer_field, r.chat_template) == ("train", "prompt", "answer", False)
    assert cfg.queue.outage_deadline_s is None
    assert load_config(None, ["queue.outage_deadline_s=60"]).queue.outage_deadline_s == 60.0


def test_help_config_lists_sections_fields_and_losses():
    text = config.schema_text()
    assert "queue.outage_deadline_s" not in text  # fields are listed under their section
    for fragment in (
        "algo:  The RL objective",
        "  outage_deadline_s: float | None = None  (> 0)",
        "  tis: 'auto' | 'none' | 'token' | 'sequence' = 'auto'",
        "Truncated importance sampling weight",
        "  type: sapo ",
        "    sapo_tau_neg: float = 1.05  (> 0)",
        "  type: package.module:function",
    ):
        assert fragment in text, fragment


def test_config_parse_imports_no_torch_and_is_quick():
    import subprocess
    import sys

    code = (
        "import sys, time; t = time.perf_counter(); from asyncrl.config import load_config; "
        "load_config('configs/demo.yaml', ['control.total_steps=5']); "
        "print(time.perf_counter() - t, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "False", "parsing a config imported torch"
    assert float(out[0]) < 3.0, f"config parse took {out[0]} s"


@pytest.mark.parametrize("shape", [["sync.sync_every=2"], ["learner.mini_batches_per_step=2"]])
def test_sync_mode_checks_the_bound_it_really_trains_with(shape):
    """The sync mode forces the staleness bound to 0: data a sync_every or mini-batch shape
    makes older than that would all be dropped as stale, and the run would wait forever."""
    rejects(
        ["control.mode=sync", "control.max_staleness=5", *shape],
        "control.mode='sync'",
        "staleness bound of 0",
        "control.mode='async'",
    )
    cfg = load_config(None, ["control.mode=async", "control.max_staleness=1", *shape])
    assert cfg.control.mode == "async"
    assert load_config(None, ["control.mode=sync"]).control.mode == "sync"


def test_mini_batches_without_overlap_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
        load_config(None, ["learner.mini_batches_per_step=2", "control.max_staleness=2"])
    assert "generation cannot overlap training" in caplog.text and "control.max_staleness=3" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
        load_config(None, ["learner.mini_batches_per_step=2", "control.max_staleness=3"])
    assert "overlap" not in caplog.text


def test_the_default_correction_is_token_tis_where_it_composes(caplog):
    """algo.correction.tis='auto' (the default) is token TIS capped at 2, in either mode; 'none'
    where a TIS weight has no place, and where engine logprobs were turned off on purpose.
    An async run left with no correction at all says so at load."""

    def tis(*overrides: str) -> tuple[str, float]:
        c = load_config(None, list(overrides)).algo.correction
        return c.tis, c.tis_cap

    with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
        assert tis() == ("token", 2.0)
        assert tis("control.mode=sync", "control.max_staleness=0") == ("token", 2.0)
        assert load_config(None, []).to_dict()["algo"]["correction"]["tis"] == "token"
        assert tis("algo.policy_loss=importance_sampling")[0] == "token"
    assert "no off-policy correction" not in caplog.text
    assert tis("algo.policy_loss=rollout_is")[0] == "none"
    assert tis("algo.policy_loss=dppo")[0] == "none"
    assert tis("algo.policy_loss=cispo", "algo.policy_loss.cispo_anchor=rollout")[0] == "none"
    assert tis("algo.policy_loss=cross_entropy")[0] == "none"
    assert tis("algo.correction.tis=sequence") == ("sequence", 2.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
        assert tis("algo.policy_loss=gmpo", "algo.loss_reduction=sequence_mean")[0] == "none"
    assert "no off-policy correction" in caplog.text and "algo.correction.tis='sequence'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
        cfg = load_config(None, ["rollout.logprobs=false"])
    assert (cfg.algo.correction.tis, cfg.rollout.logprobs) == ("none", False)
    assert "no off-policy correction" in caplog.text and "algo.correction.tis='token'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
        tis("algo.correction.tis=none", "control.mode=sync", "control.max_staleness=0")
        tis("algo.correction.tis=none", "algo.correction.geo_mask=true")
    assert "no off-policy correction" not in caplog.text


def test_critic_refuses_context_parallel():
    with pytest.raises(ConfigError, match=r"algo\.critic with learner\.context_parallel=2"):
        load_config(
            None,
            [
                "algo.advantage_estimator=gae",
                "algo.critic.enabled=true",
                "learner.num_ranks=2",
                "learner.context_parallel=2",
            ],
        )
