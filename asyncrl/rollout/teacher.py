"""The teacher of on-policy distillation (rollout.teacher): a Hugging Face causal LM in one Ray
actor, shared by every generator of the run, giving the log-prob of each token a student sampled.

    handles = start_teacher(cfg, model_path)     # the control plane, at bring-up (the student's model dir)
    wait_ready(handles)                          # loaded, its vocabulary checked against the student's
    client = TeacherClient(run, timeout_s=60)    # in each generator (GroupMaker)
    await client.logprobs(prompt_ids=[[1, 2]], response_ids=[[3, 4, 5]])    # -> [[lp3, lp4, lp5]]
    failed = await attach_teacher_logprobs(client, scorer, prompt_ids, samples, failed)  # a group's samples
    stop_reward_models(handles)                  # tear-down, as the reward models'

The student's token ids go to the teacher as they are: no detokenising and retokenising,
which could split the text differently and score other tokens than the sampled ones. That
needs one vocabulary, checked when the actor loads: the teacher's tokenizer must map every
token to the id the student's does (Qwen2.5's sizes share theirs, for instance), and its
embedding must have a row for each; otherwise the run stops at start-up with one error.

A sample is one forward over prompt + response (right-padded in a batch, so a sample scores the
same alone or batched), and the log-prob of each response token at position t comes from the
logits at t - 1, as log_softmax(logits / T)[token] with T the student's sampling temperature
(asyncrl.algo.logprobs, the learner's function). Top-k / top-p are not applied: the teacher
scores a token the student's truncation kept, and a cut of its own would give a token it ranks
low a log-prob of -inf (an infinite KL) instead of a large finite one.

The actor is the reward model's server (asyncrl.rollout.reward_model) with another model and
forward: the same batching of requests from every generator, the same restart after a crash
(``max_restarts``) with the requests in flight retried (TASK_RETRIES), and the same tear-down.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np

from asyncrl.config import Config
from asyncrl.config.teacher import TeacherConfig, check_teacher
from asyncrl.rollout.envs.base import RewardError
from asyncrl.rollout.reward_model import (
    RewardModelClient,
    RewardModelServer,
    ServerStats,
    scorer_actor,
)
from asyncrl.rollout.scoring import RewardScorer, RewardTimeout
from asyncrl.types import MIN_LOGPROB, Sample

WHERE = "rollout.teacher"


def teacher_actor_name(run: str) -> str:
    return f"{run}/teacher"


def check_vocabulary(teacher_vocab: dict[str, int], student_vocab: dict[str, int], embedding_rows: int) -> None:
    """ValueError unless every student token has the teacher's id for it and a teacher embedding row."""
    if teacher_vocab != student_vocab:
        differ = sorted(
            t for t in teacher_vocab.keys() | student_vocab.keys() if teacher_vocab.get(t) != student_vocab.get(t)
        )
        shown = ", ".join(f"{t!r}: {teacher_vocab.get(t)} vs {student_vocab.get(t)}" for t in differ[:5])
        raise ValueError(
            f"{WHERE}: its tokenizer's vocabulary is not the student's ({len(teacher_vocab)} vs "
            f"{len(student_vocab)} tokens, {len(differ)} differ; token: teacher id vs student id: {shown}); "
            f"the teacher scores the student's token ids, so both must use one tokenizer"
        )
    top = max(student_vocab.values(), default=-1)
    if top >= embedding_rows:
        raise ValueError(
            f"{WHERE}: its embedding has {embedding_rows} rows, the student's tokenizer has ids up to {top}"
        )


def check_line(spec: TeacherConfig, student_model: str) -> str:
    """``--check``'s line for the teacher: its tokenizer loaded and, when the student is a local
    directory (not 'tiny', written at start-up), its vocabulary compared with the student's
    (the embedding from config.json's vocab_size); ConfigError otherwise."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from asyncrl.config.base import ConfigError
    from asyncrl.config.reward_model import read_config_json

    architecture = check_teacher(spec)
    try:
        teacher_vocab = AutoTokenizer.from_pretrained(spec.model).get_vocab()
    except Exception as e:  # whatever a broken tokenizer directory raises, the actor would die of it
        raise ConfigError(
            f"{WHERE}.model={spec.model!r}: its tokenizer cannot be loaded: {type(e).__name__}: {e}"
        ) from e
    if not Path(student_model).is_dir():
        return f"{WHERE}.model={spec.model}: {architecture}, tokenizer loaded (its vocabulary is checked at start-up)"
    rows = read_config_json(Path(spec.model), f"{WHERE}.model={spec.model!r}").get("vocab_size")
    try:
        student_vocab = AutoTokenizer.from_pretrained(student_model).get_vocab()
    except Exception as e:  # the student's own check names it; here only the comparison is at stake
        return f"{WHERE}.model={spec.model}: {architecture}; the student's tokenizer did not load ({type(e).__name__})"
    try:
        check_vocabulary(teacher_vocab, student_vocab, rows if isinstance(rows, int) else len(teacher_vocab))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return f"{WHERE}.model={spec.model}: {architecture}, the student's vocabulary ({len(student_vocab)} tokens)"


class TeacherServer(RewardModelServer):
    """The Ray actor: one teacher model, batching log-prob requests from every generator."""

    # Not super().__init__: that loads a sequence classifier; the batching it sets up is below.
    def __init__(self, spec: TeacherConfig, student_vocab: dict[str, int], temperature: float):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # The batcher reads spec.batch_size and spec.max_wait_ms, which the teacher's config has too.
        self.spec, self.where = spec, WHERE  # type: ignore[assignment]
        self.architecture = check_teacher(spec)
        self.temperature = float(temperature)
        torch.set_num_threads(max(1, int(spec.num_cpus)))
        self.device = "cuda" if spec.num_gpus > 0 else "cpu"
        model: Any = AutoModelForCausalLM.from_pretrained(spec.model, dtype=getattr(torch, spec.dtype))
        self.vocab_rows = int(model.get_input_embeddings().weight.shape[0])
        teacher_vocab = AutoTokenizer.from_pretrained(spec.model).get_vocab()
        check_vocabulary(teacher_vocab, student_vocab, self.vocab_rows)
        self.model = model.to(self.device).eval()
        self.stats_ = ServerStats()
        self._queue: asyncio.Queue | None = None
        self._batcher: asyncio.Task | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="teacher")

    def ready(self) -> str:
        return f"{self.spec.model}: {self.architecture}, on {self.device}, log-probs at T={self.temperature:g}"

    def forward(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:  # type: ignore[override]
        """Each response token's log-prob given its prompt and the tokens before it, one forward pass."""
        import torch

        from asyncrl.algo.logprobs import logprobs_from_logits

        rows = [list(p) + list(r) for p, r in zip(prompts, completions, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention[i, : len(row)] = 1
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device)).logits
            out = []
            for i, (p, r) in enumerate(zip(prompts, completions, strict=True)):
                start = len(p) - 1  # the logits at t - 1 score token t
                picked = logits[i, start : start + len(r)]
                targets = torch.tensor(list(r), dtype=torch.long, device=picked.device)
                out.append(logprobs_from_logits(picked, targets, self.temperature).float().cpu().tolist())
        return out

    async def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:  # type: ignore[override]
        """One list of log-probs per (prompt ids, response ids), from the batch it joins."""
        for p, r in zip(prompts, completions, strict=False):
            if not p:
                raise ValueError("a sample without prompt tokens: its first token has no context to be scored in")
            bad = [t for t in (*p, *r) if not 0 <= t < self.vocab_rows]
            if bad:  # refused alone: in a batch it would fail every other sample's forward
                raise ValueError(f"token id {bad[0]} outside the teacher's vocabulary [0, {self.vocab_rows})")
        return cast(list[list[float]], await super().score(prompts, completions))  # type: ignore[arg-type]


class TeacherClient(RewardModelClient):
    """A generator's side of the teacher: finds the run's actor by name on first use; each call
    is bounded by ``timeout_s`` (rollout.teacher.timeout_s)."""

    def __init__(self, run: str | None, timeout_s: float):
        self.where = WHERE
        self.name = teacher_actor_name(run) if run is not None else None
        self.timeout_s = timeout_s
        self._handle: Any = None

    async def logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """The teacher's log-prob of every response token, per sample; raises on a failure or timeout."""
        call = self.score(prompt_ids, response_ids)  # type: ignore[arg-type]
        out = cast(list[list[float]], await asyncio.wait_for(call, self.timeout_s))
        lengths = [len(r) for r in response_ids]
        if [len(o) for o in out] != lengths:
            raise ValueError(f"{WHERE}: log-probs for {[len(o) for o in out]} tokens, asked for {lengths}")
        return out


async def attach_teacher_logprobs(
    teacher: TeacherClient, scorer: RewardScorer, group_prompt: list[int], samples: list[Sample], failed: list[int]
) -> list[int]:
    """Set each sample's teacher_logprobs (0 on observation tokens: only policy tokens are
    trained), asked in one call per group (``group_prompt``: the ids of a sample without its
    own prompt_ids); return the failed samples' indices with the teacher's failures added.

    A sample the teacher cannot score fails as a failed reward does (``scorer`` counts it and
    logs it once per kind), always with reward NaN: trained on without its teacher term (even
    with rollout.reward_on_failure), it would be plain RL. Samples whose reward failed already
    are not sent (they are not trained)."""
    ask = [i for i, s in enumerate(samples) if s.error is None and math.isfinite(s.reward) and s.num_tokens]
    for s in samples:
        if not s.num_tokens:
            s.teacher_logprobs = np.zeros(0, np.float32)
    if not ask:
        return failed
    prompts = [group_prompt if (own := samples[i].prompt_ids) is None else own.tolist() for i in ask]
    try:
        out = await teacher.logprobs(
            [list(map(int, p)) for p in prompts], [samples[i].response_ids.tolist() for i in ask]
        )
    except Exception as e:  # an actor that died for good, a timeout, a refused sample: these samples fail
        why: RewardError = RewardTimeout(f"{teacher.where} did not answer within {teacher.timeout_s:g} s")
        if not isinstance(e, TimeoutError):
            why = RewardError(f"{teacher.where} raised {type(e).__name__}: {e}")
        return _failed(scorer, samples, ask, failed, why)
    bad = []
    for i, logprobs in zip(ask, out, strict=True):
        s, values = samples[i], np.asarray(logprobs, np.float32)
        values = np.where(s.loss_mask > 0, values, np.float32(0.0))
        if not np.isfinite(values).all() or (values.size and float(values.min()) < MIN_LOGPROB):
            bad.append(i)  # the contract would dead-letter the whole group for it
            continue
        s.teacher_logprobs = values
    if bad:
        why = RewardError(f"{teacher.where} gave a non-finite log-prob or one below {MIN_LOGPROB:g}")
        failed = _failed(scorer, samples, bad, failed, why)
    return failed


def _failed(
    scorer: RewardScorer, samples: list[Sample], which: list[int], failed: list[int], why: RewardError
) -> list[int]:
    for i in which:
        scorer.failed(why)
        samples[i].reward, samples[i].error = math.nan, str(why)
    return sorted(set(failed) | set(which))


def start_teacher(cfg: Config, student_model: str) -> list[tuple[str, Any]]:
    """The teacher's actor (none without rollout.teacher), not waited for: [(where, handle)].
    ``student_model``: the student's resolved model directory, whose vocabulary is read here
    (the actor may run on a node that has not got it) and checked by the actor."""
    from transformers import AutoTokenizer

    spec = cfg.rollout.teacher
    if spec is None:
        return []
    actor = scorer_actor(TeacherServer, teacher_actor_name(cfg.control.run_name), spec)
    temperature = spec.temperature if spec.temperature is not None else cfg.rollout.temperature
    student_vocab = AutoTokenizer.from_pretrained(student_model).get_vocab()
    return [(WHERE, actor.remote(spec, student_vocab, temperature))]
