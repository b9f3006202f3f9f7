"""On-policy distillation's pieces without Ray: the advantage term against hand-computed values,
its place in the batch (masked observation tokens, composed with the task's advantage, metrics),
the record's teacher log-probs through the codec and the run's contract, the vocabulary check
and the config rules; and the teacher's forward (asyncrl.rollout.teacher) against a plain
transformers forward of the same tiny model.

.venv/bin/python -m pytest tests/unit/test_distill.py -q
"""

from __future__ import annotations

import asyncio
import math

import msgpack
import numpy as np
import pytest
import torch

from asyncrl.algo.distill import reverse_kl_per_token, teacher_advantages
from asyncrl.config import AlgoConfig, ConfigError, load_config
from asyncrl.config.teacher import TeacherConfig
from asyncrl.data.batch import build_minibatches
from asyncrl.data.codec import RecordError, decode_group, encode_group
from asyncrl.data.contract import RecordContract, check_group
from asyncrl.rollout.teacher import TeacherClient, attach_teacher_logprobs, check_vocabulary
from asyncrl.types import RolloutGroup, Sample

BEHAVIOUR = torch.tensor([[-0.5, -1.0, -2.0, 0.0], [-0.1, -0.3, 0.0, 0.0]], dtype=torch.float64)
TEACHER = torch.tensor([[-0.7, -0.2, -2.5, -9.0], [-0.4, -0.3, -5.0, -5.0]], dtype=torch.float64)
# Row 0: tokens 0, 1 and 2 are the policy's, but 1 is an observation token (multi-turn); row 1: two tokens.
MASK = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)


def test_reverse_kl_is_behaviour_minus_teacher_on_mask_tokens_only():
    k = reverse_kl_per_token(BEHAVIOUR, TEACHER, MASK)
    # By hand: -0.5 - (-0.7) = 0.2, (masked), -2.0 - (-2.5) = 0.5; -0.1 - (-0.4) = 0.3, -0.3 - (-0.3) = 0.
    expected = [[0.2, 0.0, 0.5, 0.0], [0.3, 0.0, 0.0, 0.0]]
    np.testing.assert_allclose(k.numpy(), expected, atol=1e-12)


def test_teacher_advantage_is_minus_coef_times_kl_per_token():
    adv = teacher_advantages(BEHAVIOUR, TEACHER, MASK, coef=2.0)
    np.testing.assert_allclose(adv.numpy(), [[-0.4, 0.0, -1.0, 0.0], [-0.6, 0.0, 0.0, 0.0]], atol=1e-12)


def test_discounted_sum_runs_over_policy_tokens_and_skips_observations():
    adv = teacher_advantages(BEHAVIOUR, TEACHER, MASK, coef=1.0, discount=0.5)
    # Row 0: t=2: 0.5; t=0: 0.2 + 0.5 * 0.5 (the observation token between them is skipped, not discounted).
    # Row 1: t=1: 0; t=0: 0.3 + 0.5 * 0.
    np.testing.assert_allclose(adv.numpy(), [[-0.45, 0.0, -0.5, 0.0], [-0.3, 0.0, 0.0, 0.0]], atol=1e-12)
    full = teacher_advantages(BEHAVIOUR, TEACHER, MASK, coef=1.0, discount=1.0)
    np.testing.assert_allclose(full.numpy()[0], [-0.7, 0.0, -0.5, 0.0], atol=1e-12)
    with pytest.raises(ValueError, match="discount"):
        teacher_advantages(BEHAVIOUR, TEACHER, MASK, coef=1.0, discount=1.5)
    with pytest.raises(ValueError, match="one shape"):
        reverse_kl_per_token(BEHAVIOUR, TEACHER[:, :3], MASK)


def _sample(lp, teacher, mask, reward, **kw) -> Sample:
    n = len(lp)
    return Sample(
        response_ids=np.arange(3, 3 + n),
        rollout_logprobs=np.array(lp),
        loss_mask=np.array(mask),
        reward=reward,
        behavior_version=1,
        teacher_logprobs=None if teacher is None else np.array(teacher),
        **kw,
    )


def _teacher(coef=1.0, discount=0.0) -> TeacherConfig:
    return TeacherConfig.model_construct(model="unused", coef=coef, discount=discount)


def test_batch_adds_the_teacher_term_to_the_task_advantage_on_the_loss_mask():
    group = RolloutGroup(
        "g",
        "g",
        np.array([1, 2]),
        [
            _sample([-0.5, -1.0, -2.0], [-0.7, -0.2, -2.5], [1, 0, 1], 1.0),  # an observation token in the middle
            _sample([-0.1, -0.3], [-0.4, -0.3], [1, 1], 0.0),
            _sample([-0.2], None, [1], math.nan, error="reward raised"),  # failed: no term, no teacher needed
        ],
    )
    algo = AlgoConfig(advantage_estimator="dr_grpo")
    (mb,), metrics = build_minibatches([group], algo, num_minibatches=1, teacher=_teacher(coef=2.0))
    # dr_grpo over the two valid rewards {1, 0}: +0.5 and -0.5 per token, plus -2 * k_t.
    np.testing.assert_allclose(mb[0].advantages, [0, 0, 0.5 - 0.4, 0.0, 0.5 - 1.0], atol=1e-6)
    np.testing.assert_allclose(mb[1].advantages, [0, 0, -0.5 - 0.6, -0.5], atol=1e-6)
    np.testing.assert_allclose(mb[2].advantages, [0, 0, 0], atol=1e-6)
    # KL per loss token: (0.2 + 0.5 + 0.3 + 0) / 4; per sample: (0.7 + 0.3) / 2.
    assert metrics["teacher/kl_mean"] == pytest.approx(0.25)
    assert metrics["teacher/kl_seq_mean"] == pytest.approx(0.5)
    assert metrics["teacher/adv_abs_mean"] == pytest.approx(2 * 0.25)
    assert metrics["teacher/missing_samples"] == 0
    (plain,), plain_metrics = build_minibatches([group], algo, num_minibatches=1)
    np.testing.assert_allclose(plain[0].advantages, [0, 0, 0.5, 0.0, 0.5], atol=1e-6)
    assert "teacher/kl_mean" not in plain_metrics


def test_a_sample_without_teacher_logprobs_is_left_out_of_the_loss_not_trained_as_plain_rl():
    group = RolloutGroup("g", "g", np.array([1]), [_sample([-0.1], None, [1], 1.0), _sample([-0.1], [-0.2], [1], 0.0)])
    (mb,), metrics = build_minibatches([group], AlgoConfig(), num_minibatches=1, teacher=_teacher())
    assert mb[0].loss_mask.tolist() == [0, 0] and mb[0].reduction_weights.tolist() == [0, 0]
    assert mb[1].loss_mask.tolist() == [0, 1] and metrics["teacher/missing_samples"] == 1
    assert metrics["teacher/kl_mean"] == pytest.approx(0.1)


def _group(teacher) -> RolloutGroup:
    return RolloutGroup("g", "g", np.array([1, 2]), [_sample([-0.5, -1.0], teacher, [1, 1], 1.0) for _ in range(2)])


def test_teacher_logprobs_round_trip_and_old_records_without_the_field_still_decode():
    back = decode_group(encode_group(_group([-0.25, -3.0])))
    assert back.samples[0].teacher_logprobs.tolist() == [-0.25, -3.0]
    plain = encode_group(_group(None))
    assert b"teacher_logprobs" not in plain  # written only when present
    assert decode_group(plain).samples[0].teacher_logprobs is None


def _with_teacher_array(dtype: str, values: np.ndarray) -> bytes:
    obj = msgpack.unpackb(encode_group(_group(None)), raw=False)
    array = {"dtype": dtype, "shape": [len(values)], "data": values.tobytes()}
    obj["samples"][1]["teacher_logprobs"] = array
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (_with_teacher_array("<f4", np.array([-0.5, np.nan], "<f4")), "nonfinite_teacher_logprob"),
        (_with_teacher_array("<f4", np.array([-np.inf, -1.0], "<f4")), "nonfinite_teacher_logprob"),
        (_with_teacher_array("<f4", np.array([-0.5], "<f4")), "length_mismatch"),
        (_with_teacher_array("<f8", np.array([-0.5, -1.0], "<f8")), "bad_dtype"),
    ],
)
def test_bad_teacher_logprobs_are_refused_with_their_reason(data, reason):
    with pytest.raises(RecordError) as info:
        decode_group(data)
    assert info.value.reason == reason and "samples[1]" in str(info.value)


CONTRACT = RecordContract(vocab_size=32, max_len=16, group_size=2, stepwise=False, max_version=4, teacher=True)


def test_the_contract_of_a_distilling_run_wants_teacher_logprobs_that_are_logprobs():
    check_group(_group([-0.25, -3.0]), CONTRACT)
    with pytest.raises(RecordError) as info:
        check_group(_group(None), CONTRACT)
    assert info.value.reason == "missing_teacher_logprobs"
    with pytest.raises(RecordError) as info:
        check_group(_group([-0.25, 0.5]), CONTRACT)
    assert info.value.reason == "positive_logprob" and "teacher_logprobs" in str(info.value)
    failed = _group(None)
    for s in failed.samples:  # the teacher (or the reward) failed: excluded from the loss anyway
        s.reward, s.error = math.nan, "rollout.teacher did not answer within 60 s"
    check_group(failed, CONTRACT)
    check_group(_group(None), RecordContract(32, 16, 2, False, 4))  # a run without a teacher


def test_a_finite_yet_absurd_log_prob_is_dead_lettered_not_made_an_advantage():
    """-1e30 is finite: without a floor it became a -1e30 advantage (teacher) or +1e30 (rollout)."""
    check_group(_group([-0.25, -5e5]), CONTRACT)  # very negative, yet a log-prob a real teacher may give
    for teacher, rollout in (([-0.25, -1e30], [-0.5, -1.0]), ([-0.25, -3.0], [-1e30, -1.0])):
        group = _group(teacher)
        for s in group.samples:
            s.rollout_logprobs = np.array(rollout, np.float32)
        with pytest.raises(RecordError) as info:
            check_group(group, CONTRACT)
        assert info.value.reason == "logprob_out_of_range"
    observation = _group([-0.25, -1e30])
    for s in observation.samples:  # an observation token's log-prob is never trained
        s.loss_mask = np.array([1, 0], np.int8)
    check_group(observation, CONTRACT)


def test_vocabulary_check_names_the_tokens_that_differ():
    vocab = {"a": 0, "b": 1, "<eos>": 2}
    check_vocabulary(vocab, dict(vocab), embedding_rows=3)
    with pytest.raises(ValueError, match=r"'b': 1 vs 2.*one tokenizer"):
        check_vocabulary(vocab, {"a": 0, "b": 2, "<eos>": 1}, embedding_rows=3)
    with pytest.raises(ValueError, match="embedding has 2 rows"):
        check_vocabulary(vocab, dict(vocab), embedding_rows=2)


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory) -> str:
    from asyncrl.rollout.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("teacher"), alphabet="abc", seed=7))


def test_config_rules(tiny_teacher, tmp_path):
    cfg = load_config(None, [f"rollout.teacher={{model: {tiny_teacher}, coef: 0.5}}"])
    assert cfg.rollout.teacher is not None and cfg.rollout.teacher.coef == 0.5
    with pytest.raises(ConfigError, match="drop_uniform_groups"):
        load_config(None, [f"rollout.teacher={{model: {tiny_teacher}}}", "rollout.drop_uniform_groups=true"])
    with pytest.raises(ConfigError, match=r"rollout\.logprobs=false"):
        load_config(None, [f"rollout.teacher={{model: {tiny_teacher}}}", "rollout.logprobs=false"])
    with pytest.raises(ConfigError, match="no such directory"):
        load_config(None, [f"rollout.teacher={{model: {tmp_path / 'nope'}}}"])
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    with pytest.raises(ConfigError, match="not a causal language model"):
        load_config(None, [f"rollout.teacher={{model: {tmp_path}}}"])
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ConfigError, match=r"no weights \(\*\.safetensors"):  # it failed only in the actor, Ray up
        load_config(None, [f"rollout.teacher={{model: {tmp_path}}}"])
    with pytest.raises(ConfigError):
        load_config(None, [f"rollout.teacher={{model: {tiny_teacher}, coef: 0}}"])
    with pytest.raises(ConfigError, match="ignores the advantages"):  # it trained SFT on the student's own samples
        load_config(None, [f"rollout.teacher={{model: {tiny_teacher}}}", "algo.policy_loss={type: cross_entropy}"])
    for coef in ("1e300", ".inf", ".nan"):  # 1e300 is finite, yet its advantages were -inf in float32
        with pytest.raises(ConfigError, match=r"rollout\.teacher\.coef"):
            load_config(None, [f"rollout.teacher={{model: {tiny_teacher}, coef: {coef}}}"])
    # An infinite wait for a fuller batch, timeout, temperature or Ray resource: refused, each naming its field.
    for field in ("max_wait_ms", "timeout_s", "temperature", "num_cpus", "num_gpus", "discount"):
        for value in (".inf", ".nan"):
            with pytest.raises(ConfigError, match=rf"rollout\.teacher\.{field}") as info:
                load_config(None, [f"rollout.teacher={{model: {tiny_teacher}, {field}: {value}}}"])
            assert "\n" not in str(info.value).strip()


def test_teacher_forward_matches_transformers_logprobs_alone_and_batched(tiny_teacher):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.rollout.teacher import TeacherServer

    vocab = AutoTokenizer.from_pretrained(tiny_teacher).get_vocab()
    server = TeacherServer(TeacherConfig(model=tiny_teacher), vocab, temperature=0.7)
    assert len(vocab) >= 6
    prompts = [[1, 3, 4], [1, 5], [1, 3, 3, 4, 5, 4]]
    responses = [[3, 4, 5, 2], [4], [5, 5, 3]]
    got = server.forward(prompts, responses)
    model = AutoModelForCausalLM.from_pretrained(tiny_teacher).eval()
    for p, r, lp in zip(prompts, responses, got, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0].double()
        expected = [torch.log_softmax(logits[len(p) - 1 + j] / 0.7, -1)[tok].item() for j, tok in enumerate(r)]
        assert lp == pytest.approx(expected, abs=1e-5)
        assert server.forward([p], [r])[0] == pytest.approx(lp, abs=1e-5)  # padding changes nothing
    with pytest.raises(ValueError, match="one tokenizer"):
        TeacherServer(TeacherConfig(model=tiny_teacher), {**vocab, "zz": len(vocab)}, temperature=1.0)


def test_the_example_config_loads_once_its_teacher_is_written(tmp_path, monkeypatch):
    from pathlib import Path

    from asyncrl.rollout.tiny import write_tiny_model

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)  # the example names runs/distill-teacher/hf, relative to where it runs
    with pytest.raises(ConfigError, match=r"rollout.teacher.model='runs/distill-teacher/hf': no such directory"):
        load_config(root / "configs" / "distill.yaml")
    write_tiny_model(tmp_path / "runs" / "distill-teacher" / "hf", alphabet="abc")
    teacher = load_config(root / "configs" / "distill.yaml").rollout.teacher
    assert teacher is not None and (teacher.coef, teacher.discount) == (1.0, 0.0)


def test_check_compares_the_teachers_vocabulary_with_a_local_students(tiny_teacher, tmp_path):
    from asyncrl.control.preflight import check_imports
    from asyncrl.rollout.tiny import write_tiny_model

    student = write_tiny_model(tmp_path / "student", alphabet="abc", seed=3)
    teacher = f"rollout.teacher={{model: {tiny_teacher}}}"
    env = "rollout.env_kwargs={alphabet: abc, min_len: 3, max_len: 3}"
    lines = check_imports(load_config(None, [teacher, env, f"rollout.model={student}"]))
    assert any(line.startswith("rollout.teacher.model=") and "the student's vocabulary" in line for line in lines)
    other = write_tiny_model(tmp_path / "other", alphabet="abcd", seed=3)
    with pytest.raises(ConfigError, match=r"rollout\.teacher: its tokenizer's vocabulary is not the student's"):
        check_imports(load_config(None, [teacher, env, f"rollout.model={other}"]))
    tiny = check_imports(load_config(None, [teacher, env]))  # 'tiny' is written at start-up: checked then
    assert any("its vocabulary is checked at start-up" in line for line in tiny)


class _InProcessTeacher(TeacherClient):
    """The real TeacherServer's forward, called here rather than through its Ray actor."""

    def __init__(self, server):
        super().__init__("unit", timeout_s=60)
        self.server = server

    async def score(self, prompts, completions, **_columns):  # type: ignore[override]
        return self.server.forward(prompts, completions)


def test_a_teacher_log_prob_below_the_floor_fails_its_sample_not_the_group(tiny_teacher):
    """At T = 1e-9 the tiny teacher's log-prob of a token it does not rank first is ~ -1e9:
    attached, the contract would dead-letter the whole group (logprob_out_of_range); instead that
    sample fails at the generator, counted as a failed reward, and the others keep theirs."""
    from transformers import AutoTokenizer

    from asyncrl.rollout.envs import make_env
    from asyncrl.rollout.scoring import RewardLimits, RewardScorer
    from asyncrl.rollout.teacher import TeacherServer

    vocab = AutoTokenizer.from_pretrained(tiny_teacher).get_vocab()
    cold = TeacherServer(TeacherConfig(model=tiny_teacher), vocab, temperature=1e-9)
    prompt = [1, 3, 4]
    scores = cold.forward([prompt] * 3, [[3], [4], [5]])
    low = [k for k, lp in enumerate(scores) if lp[0] < -1e6]
    assert low and len(low) < 3  # the argmax among 3, 4, 5 scores ~0, the others far below the floor
    samples = [Sample(np.array([t]), np.array([-0.5]), np.array([1]), 1.0, 0) for t in (3, 4, 5)]
    scorer = RewardScorer(make_env("copy", {}), RewardLimits())
    failed = asyncio.run(attach_teacher_logprobs(_InProcessTeacher(cold), scorer, prompt, samples, []))
    assert failed == low and scorer.errors == len(low)
    for k, s in enumerate(samples):
        if k in low:
            assert s.teacher_logprobs is None and math.isnan(s.reward) and "below -1e+06" in s.error
        else:
            assert s.teacher_logprobs is not None and s.teacher_logprobs[0] >= -1e6
    check_group(RolloutGroup("g", "g", np.array(prompt), samples), RecordContract(32, 16, 3, False, 4, teacher=True))


def test_the_teacher_term_survives_the_stepwise_merge_of_a_trajectorys_steps():
    """Step-wise multi-turn: each step's own term on its own tokens, kept when step 1's sequence
    (which extends step 0's) is merged with it; the observation token between them gets none."""

    def trajectory(tid: int, reward: float) -> list[Sample]:
        kw = {"reward": reward, "behavior_version": 1, "trajectory_id": tid}
        first = Sample(np.array([5, 6]), np.array([-0.5, -0.5]), np.array([1, 1]), **kw, step_index=0,
                       teacher_logprobs=np.array([-1.5, -0.5]), prompt_ids=np.array([1, 2]))  # fmt: skip
        second = Sample(np.array([7]), np.array([-0.2]), np.array([1]), **kw, step_index=1,
                        teacher_logprobs=np.array([-0.7]), prompt_ids=np.array([1, 2, 5, 6, 9]))  # fmt: skip
        return [first, second]

    group = RolloutGroup("g", "g", np.array([1, 2]), trajectory(0, 1.0) + trajectory(1, 0.0))
    algo = AlgoConfig(stepwise=True, advantage_estimator="dr_grpo")
    (mb,), metrics = build_minibatches([group], algo, num_minibatches=1, teacher=_teacher())
    assert metrics["stepwise/num_seq_after_merge"] == 2
    assert [s.input_ids.tolist() for s in mb] == [[1, 2, 5, 6, 9, 7]] * 2
    # dr_grpo: +0.5 / -0.5 per trajectory; k = (1.0, 0.0) on step 0 and 0.5 on step 1.
    np.testing.assert_allclose(mb[0].advantages, [0, 0, 0.5 - 1.0, 0.5, 0, 0.5 - 0.5], atol=1e-6)
    np.testing.assert_allclose(mb[1].advantages, [0, 0, -0.5 - 1.0, -0.5, 0, -0.5 - 0.5], atol=1e-6)
