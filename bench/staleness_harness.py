"""The staleness study's harness: one training run, in this process, at an exact staleness.

    learner = HarnessLearner.start(cfg, model_dir)         # the trainer's rank code, world size 1 (gloo)
    ring = SnapshotRing(k + 1)                             # the last k+1 published weights
    sampler = Sampler(model_dir, env, cfg.rollout)         # a plain torch sampler, per-token log-probs
    ... groups = sampler.groups(ring.get(t - k), prompts, version=t - k)
    ... learner.train(groups)                              # build_minibatches + LearnerActor.train_minibatch

What is real: batch building (asyncrl.data.batch.build_minibatches: advantages, reduction
weights), the micro-batch planning and collation, the learner rank's step
(asyncrl.learner.actor.LearnerActor.train_minibatch: FSDP2 model on a one-rank gloo group,
microbatch_loss with the policy loss and the off-policy correction, clip, AdamW, schedule),
the environment's prompts and rewards. What stands in for the engine: `Sampler`, which
samples with the weights exactly k versions old (a real async run sees a mix of ages up to
k; exactly k is the worst case the bound allows) and records each token's log-prob from the
logits it sampled from, with the same disallowed-token mask and temperature the learner uses.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.algo.logprobs import logprobs_from_logits
from asyncrl.config import Config, RolloutConfig
from asyncrl.data import microbatch as mbatch
from asyncrl.data.batch import build_minibatches
from asyncrl.data.tokens import sampleable_ids
from asyncrl.learner import fsdp, loss, optim, step
from asyncrl.learner.actor import LearnerActor
from asyncrl.learner.group import FIELD_DTYPES, combine_minibatch_metrics
from asyncrl.learner.validate import validate_minibatches
from asyncrl.rollout.envs import Environment, score
from asyncrl.rollout.prompts import encode_prompt
from asyncrl.seeding import learner_seed
from asyncrl.types import RolloutGroup, Sample


class SnapshotRing:
    """The last `size` published weights, by version: `get(v)` is exactly version v's."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size={size}: must be >= 1")
        self._ring: deque[tuple[int, dict[str, torch.Tensor]]] = deque(maxlen=size)

    def put(self, version: int, state: dict[str, torch.Tensor]) -> None:
        if self._ring and version != self._ring[-1][0] + 1:
            raise ValueError(f"version {version} after {self._ring[-1][0]}: versions must be consecutive")
        self._ring.append((version, {k: v.detach().clone() for k, v in state.items()}))

    def get(self, version: int) -> dict[str, torch.Tensor]:
        for v, state in self._ring:
            if v == version:
                return state
        held = [v for v, _ in self._ring]
        raise KeyError(f"version {version} is not held (the ring holds {held})")

    @property
    def versions(self) -> list[int]:
        return [v for v, _ in self._ring]


@dataclass
class Prompt:
    text: str
    metadata: dict
    ids: list[int]


class Sampler:
    """The engine's stand-in: a plain Hugging Face model, loaded with a snapshot's weights,
    samples n responses per prompt (prompts of one length at a time, so no padding) by
    recomputing the whole sequence per token, the learner's own forward; each token's
    log-prob is log_softmax(logits / T) at the sampled token under the learner's
    disallowed-token mask (asyncrl.learner.step.policy_logits)."""

    def __init__(self, model_dir: str, env: Environment, rollout: RolloutConfig, sample_special_tokens: bool) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if rollout.top_k != -1 or rollout.top_p != 1.0:
            raise ValueError("the harness samples with top_k=-1 and top_p=1 only")
        self.env, self.rollout = env, rollout
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        vocab = self.model.config.vocab_size
        allowed = None if sample_special_tokens else sampleable_ids(self.tokenizer)
        self.disallowed = step.disallowed_mask(allowed, vocab, torch.device("cpu"))
        self.eos = int(self.tokenizer.eos_token_id)

    def prompts(self, rng: random.Random, count: int) -> list[Prompt]:
        out = []
        for _ in range(count):
            text, meta = self.env.make_prompt(rng)
            out.append(Prompt(text, meta, encode_prompt(self.tokenizer, text)))
        return out

    @torch.no_grad()
    def sample(self, state: dict[str, torch.Tensor], prompt_ids: torch.Tensor, gen: torch.Generator):
        """[B, P] prompts -> per row (response ids, log-probs, stop reason)."""
        self.model.load_state_dict(state)
        seqs, temp = prompt_ids, self.rollout.temperature
        rows = prompt_ids.shape[0]
        done = torch.zeros(rows, dtype=torch.bool)
        tokens, logps = [], []
        for _ in range(self.rollout.max_tokens):
            logits = step.policy_logits(self.model, seqs, self.disallowed)[:, -1]
            probs = torch.softmax(logits / temp, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            lp = logprobs_from_logits(logits.unsqueeze(1), nxt.unsqueeze(1), temp).squeeze(1)
            tokens.append(nxt)
            logps.append(lp)
            seqs = torch.cat([seqs, nxt.unsqueeze(1)], dim=1)
            done = done | (nxt == self.eos)
            if bool(done.all()):
                break
        tok, lps = torch.stack(tokens, 1), torch.stack(logps, 1)
        out = []
        for r in range(rows):
            ids = tok[r].tolist()
            end = ids.index(self.eos) + 1 if self.eos in ids else len(ids)
            out.append((ids[:end], lps[r, :end].numpy(), "stop" if self.eos in ids else "length"))
        return out

    def groups(
        self, state: dict[str, torch.Tensor], prompts: list[Prompt], *, version: int, gen: torch.Generator, tag: str
    ) -> list[RolloutGroup]:
        """n samples per prompt with `state` (the weights of `version`), scored by the env."""
        n = self.rollout.n_samples
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p.ids), []).append(i)
        results: dict[int, list] = {}
        for idx in by_len.values():
            batch = torch.tensor([prompts[i].ids for i in idx for _ in range(n)], dtype=torch.long)
            rows = self.sample(state, batch, gen)
            for j, i in enumerate(idx):
                results[i] = rows[j * n : (j + 1) * n]
        groups = []
        for i, p in enumerate(prompts):
            samples = []
            for ids, lps, stop in results[i]:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                samples.append(
                    Sample(
                        response_ids=np.asarray(ids, np.int32),
                        rollout_logprobs=lps.astype(np.float32),
                        loss_mask=np.ones(len(ids), np.uint8),
                        reward=score(self.env, p.text, text, p.metadata),
                        behavior_version=version,
                        stop_reason=stop,
                        token_versions=np.full(len(ids), version, np.int32),
                    )
                )
            groups.append(RolloutGroup(f"{tag}-{i}", f"{tag}-{i}", np.asarray(p.ids, np.int32), samples, metadata={}))
        return groups


class HarnessLearner(LearnerActor):
    """LearnerActor, the trainer's rank, in this process: `start` replaces `setup`'s Ray parts
    (node ids, the rendezvous) with a one-rank gloo group made once per process; the model,
    optimizer, schedule, sampling settings and disallowed mask are built as setup builds them,
    and `train` runs the driver's half of a trainer step (LearnerGroup.train_step) around the
    rank's own train_minibatch."""

    @classmethod
    def start(cls, cfg: Config, model_dir: str, *, sample_special_tokens: bool) -> HarnessLearner:
        import torch.distributed as dist

        self = cls(cfg, model_dir, rank=0, world_size=1, sample_special_tokens=sample_special_tokens)
        lc = cfg.learner
        torch.manual_seed(learner_seed(cfg))
        np.random.seed(learner_seed(cfg))
        self.device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        mesh = fsdp.build_mesh(self.device, 1)
        self.model = fsdp.load_sharded_model(model_dir, mesh, device=self.device, dtype=lc.dtype)
        self.reference = None
        if cfg.algo.kl_coef > 0:
            raise ValueError("the harness runs without a reference model (algo.kl_coef = 0)")
        if lc.context_parallel > 1:
            raise ValueError("the harness runs one rank (learner.context_parallel = 1)")
        self.cp = None  # every attribute train_minibatch reads that setup would set
        self.optimizer = optim.build_optimizer(self.model.parameters(), lc)
        total = cfg.control.total_steps * lc.mini_batches_per_step
        self.scheduler = optim.build_scheduler(self.optimizer, lc, total_steps=total)
        self.sampling = loss.Sampling.of(cfg.rollout)
        self.logprob_fn = self.sampling.logprob_fn()
        self.disallowed = self._disallowed_tokens()
        self.pad_token_id = int(self.model.config.pad_token_id or 0)
        return self

    def weights(self) -> dict[str, torch.Tensor]:
        """The full weights, HF names (what a publish sends)."""
        return fsdp.full_state_dict(self.model)

    def train(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """One trainer step over `groups`: its merged metrics (the trainer's names)."""
        cfg = self.cfg
        m = cfg.learner.mini_batches_per_step
        minibatches, batch_metrics = build_minibatches(
            groups, cfg.algo, num_minibatches=m, max_new_tokens=cfg.rollout.max_tokens
        )
        validate_minibatches(minibatches, cfg.algo, max_positions=1 << 20)
        plans = []
        for mb in minibatches:
            seqs = [mbatch.seq_fields(s) for s in mb]
            lengths = [len(s["input_ids"]) for s in seqs]
            (plan,), count = mbatch.plan_microbatches(
                [lengths], cfg.learner.micro_batch_tokens, packing=cfg.learner.packing
            )
            plans.append(([[seqs[i] for i in idx] for idx in plan], count))
        several = len(plans) > 1
        if several:  # as LearnerGroup.train_step: every mini-batch's proximal policy is the step's start
            for j, (plan, count) in enumerate(plans):
                self.store_proximal(j, plan, count, FIELD_DTYPES)
        results = [
            self.train_minibatch(plan, count, FIELD_DTYPES, j if several else None)
            for j, (plan, count) in enumerate(plans)
        ]
        metrics = combine_minibatch_metrics([r.metrics for r in results])
        metrics["learner/grad_norm"] = float(np.mean([r.grad_norm for r in results]))
        return {**batch_metrics, **metrics}
