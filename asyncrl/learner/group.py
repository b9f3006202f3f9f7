"""LearnerGroup: the driver's handle on N FSDP2 ranks running as Ray actors.

    group = LearnerGroup(cfg, model_path, sample_special_tokens=False)  # num_ranks actors, gloo/NCCL
    result = group.train_step(minibatches)                # list[list[TrainSequence]] -> StepResult
    path, version = group.export_to_file("/dev/shm/asyncrl/weights.safetensors")
    group.save_checkpoint("runs/x/checkpoints/step_000010", extra={"acked": [...]})
    group.shutdown()

Per mini-batch the driver validates the data (validate.py: a bad batch fails here, before
any collective), deals sequences to ranks balancing tokens, and plans each rank's
micro-batches with the same deterministic splitter, so it knows the common micro-batch
count and every rank pads up to it. Results are gathered with ray.wait: the first rank to
fail ends the call. A rank that died raises LearnerError at once; a rank that raised
re-raises its exception with its traceback (Ray's RayTaskError). Either way the group is
then marked broken, since the surviving ranks may be stuck in a collective (they give up
after `collective_timeout_s`); shutdown() kills them by actor handle.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import numpy as np
import torch

from asyncrl.config import Config
from asyncrl.data import microbatch as mbatch
from asyncrl.data.images import ImageLimits
from asyncrl.data.pixels import ImagePixels
from asyncrl.infra import actor_state
from asyncrl.learner import checkpoint, placement
from asyncrl.learner.actor import LearnerActor
from asyncrl.learner.result import RankStepResult, StepResult
from asyncrl.learner.validate import validate_minibatches
from asyncrl.rundir import read_extra
from asyncrl.rundir.store import RunPath, remove_tree, run_path
from asyncrl.types import MetricValue, TrainSequence, WeightsObject, merge_metrics

log = logging.getLogger(__name__)

FIELD_DTYPES = {name: ("int64" if name in mbatch.INTEGER_FIELDS else "float32") for name in mbatch.SEQUENCE_FIELDS}


_LOST_PEER = re.compile(r"connection|peer|socket|closed|reset|broken pipe|timed out", re.IGNORECASE)
"""What a rank's collective raises when another rank vanished (gloo: "Connection closed by
peer"; NCCL: "remote process exited or there was a network error")"""


class LearnerError(RuntimeError):
    """The learner group cannot go on (a rank died or timed out); restart it from a checkpoint."""


def combine_minibatch_metrics(per_minibatch: list[dict[str, MetricValue]]) -> dict[str, float]:
    """One value per metric over a step's mini-batches.

    Within a mini-batch, parts were merged by their reduction (a sum metric is the mini-batch
    total, e.g. its loss). Across mini-batches: sum metrics are averaged (the mean mini-batch
    loss, comparable for any mini_batches_per_step), mean metrics pooled, max/min merged.
    """
    out: dict[str, float] = {}
    names = {k for part in per_minibatch for k in part}
    for name in sorted(names):
        present = [part[name] for part in per_minibatch if name in part]
        if present[0].reduce == "sum":
            out[name] = float(np.mean([m.value for m in present]))
        else:
            out[name] = merge_metrics([{name: m} for m in present])[name].value
    return out


class LearnerGroup:
    """N LearnerActor ranks forming one torch.distributed group; see the module docstring."""

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        *,
        sample_special_tokens: bool,
        num_ranks: int | None = None,
        collective_timeout_s: float = 300.0,
        model_package: dict | None = None,
    ) -> None:
        """`sample_special_tokens`: the environment's (``Environment.sample_special_tokens``);
        False masks the special tokens but EOS out of the logits, as the generators do."""
        import ray
        from transformers import AutoConfig

        self.cfg = cfg
        self.model_path = model_path
        self.num_ranks = num_ranks or cfg.learner.num_ranks
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks={self.num_ranks}: must be >= 1")
        self.context_parallel = cfg.learner.context_parallel
        if self.num_ranks % self.context_parallel:
            raise ValueError(
                f"learner.context_parallel={self.context_parallel} must divide the {self.num_ranks} learner ranks"
            )
        self.micro_batch_tokens = cfg.learner.micro_batch_tokens
        self.collective_timeout_s = collective_timeout_s
        hf = AutoConfig.from_pretrained(model_path)
        self.pad_token_id = mbatch.model_pad_token_id(hf)  # in the vocabulary (a VL config's default need not be)
        text = hf.get_text_config()  # a vision-language model's language model; a text model's own config
        self.max_positions = int(text.max_position_embeddings)
        self.vocab_size = int(text.vocab_size)
        # A vision-language model's image processor: build_minibatches makes pixel values with it.
        self.pixels = ImagePixels.of(model_path, ImageLimits.of(cfg.rollout.images), config=hf)
        if self.pixels is not None and cfg.algo.critic.enabled:
            raise ValueError("algo.critic: not for a vision-language model (the critic is a text model's value head)")
        if self.pixels is not None and cfg.learner.lora is not None:
            # Its default targets (q/k/v_proj) match the vision tower's too, where vLLM's LoRA has none.
            raise ValueError("learner.lora: not for a vision-language model yet (untested with the vision tower)")
        self._version = 0
        self._broken: str | None = None
        self.actors: list = []
        self._pg, order = placement.reserve_ranks(cfg.learner, self.num_ranks)
        try:
            remote = ray.remote(LearnerActor)
            self.actors = [
                remote.options(max_restarts=0, **placement.rank_options(self._pg, order[r])).remote(
                    cfg,
                    model_path,
                    rank=r,
                    world_size=self.num_ranks,
                    sample_special_tokens=sample_special_tokens,
                    collective_timeout_s=collective_timeout_s,
                    model_package=model_package,
                )
                for r in range(self.num_ranks)
            ]
            # Rank 0's node picks the address and port: the driver's loopback is nobody else's.
            self.master_addr, port = self._gather([self.actors[0].rendezvous_point.remote()], "rendezvous")[0]
            self.rank_info = self._gather([a.setup.remote(self.master_addr, port) for a in self.actors], "setup")
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ plumbing

    def _gather(self, refs: list, what: str, timeout_s: float | None = None) -> list:
        """ray.get over all ranks that fails on the first failure instead of waiting for all."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self._broken:
            raise LearnerError(f"learner group is broken ({self._broken}); restart it from a checkpoint")
        deadline = time.monotonic() + (timeout_s or self.collective_timeout_s + 60.0)
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._broken = f"{what} timed out"
                raise LearnerError(
                    f"learner {what} timed out: ranks {sorted(rank_of[r] for r in pending)} did not answer"
                )
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, 5.0))
            for ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except RayActorError as e:
                    self._broken = f"rank {rank_of[ref]} died"
                    raise LearnerError(f"learner rank {rank_of[ref]} died during {what}: {e}") from e
                except GetTimeoutError:  # pragma: no cover - ready refs do not time out
                    pending.append(ref)
                except Exception as e:
                    self._broken = f"rank {rank_of[ref]} raised during {what}"
                    dead = self._dead_rank(pending, rank_of) if _LOST_PEER.search(str(e)) else None
                    if dead is not None:  # the root cause: the others only lost their peer
                        self._broken = f"rank {dead} died"
                        raise LearnerError(
                            f"learner rank {dead} died during {what} (rank {rank_of[ref]} "
                            f"then failed in its collective: {type(e).__name__})"
                        ) from e
                    raise
        return ray.get(refs)

    def check_alive(self) -> None:
        """LearnerError naming a rank whose actor is dead. The trainer calls it while it waits
        for data: no learner call is in flight then, so nothing else would notice a rank (or
        its node) dying until the next step, and that step may never come."""
        for r, actor in enumerate(getattr(self, "actors", [])):
            if actor_state(actor)[0] == "DEAD":
                self._broken = f"rank {r} died"
                raise LearnerError(f"learner rank {r} died while the trainer waited for data")

    @staticmethod
    def _dead_rank(pending: list, rank_of: dict, wait_s: float = 30.0) -> int | None:
        """A rank whose actor died, if one did: when a rank's process (or its node) dies
        mid-collective, its peers fail at once with a transport error, before Ray has declared
        the dead actor; that rank is what the user must be told about."""
        import ray
        from ray.exceptions import RayActorError

        deadline = time.monotonic() + wait_s
        while pending and time.monotonic() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except RayActorError:
                    return rank_of[ref]
                except Exception:  # another peer that lost the collective
                    continue
        return None

    def _call(
        self, method: str, per_rank_args: list[tuple] | None = None, *, what: str | None = None, **kwargs: Any
    ) -> list:
        args = per_rank_args or [()] * self.num_ranks
        refs = [getattr(a, method).remote(*args[r], **kwargs) for r, a in enumerate(self.actors)]
        return self._gather(refs, what or method)

    def _plan(self, sequences: list[dict[str, np.ndarray]]) -> tuple[list[list[list[dict]]], int, list]:
        """Deal to ranks, split each share by the budget; return per-rank micro-batch lists of
        sequences, the common count, and where each (rank, micro-batch, row) came from."""
        lengths = [len(s["input_ids"]) for s in sequences]
        # Dealt to the data-parallel groups; the ranks of a context-parallel group (consecutive
        # ranks) all get their group's share and split each packed row among themselves.
        cp = self.context_parallel
        shares = [s for s in mbatch.deal_to_ranks(lengths, self.num_ranks // cp) for _ in range(cp)]
        plans, count = mbatch.plan_microbatches(
            [[lengths[i] for i in share] for share in shares], self.micro_batch_tokens, packing=self.cfg.learner.packing
        )
        per_rank, origin = [], []
        for share, plan in zip(shares, plans, strict=True):
            per_rank.append([[sequences[share[i]] for i in mb] for mb in plan])
            origin.append([[share[i] for i in mb] for mb in plan])
        return per_rank, count, origin

    # ------------------------------------------------------------------ training

    @property
    def version(self) -> int:
        """The policy version: optimizer steps taken (restored by load_checkpoint)."""
        return self._version

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """Label the current weights `version` on every rank (resume: see LoopState.renumber)."""
        versions = self._call("set_version", [(int(version),)] * self.num_ranks, what="set_version")
        self._version = int(versions[0])

    def train_step(self, minibatches: list[list[TrainSequence]]) -> StepResult:
        """One optimizer step (one policy version) per mini-batch; the version reached and the
        merged metrics as floats."""
        validate_minibatches(
            minibatches, self.cfg.algo, max_positions=self.max_positions, vocab_size=self.vocab_size, pixels=self.pixels
        )
        t0 = time.perf_counter()
        results: list[list[RankStepResult]] = []
        plans = [self._plan([mbatch.seq_fields(s) for s in mb])[:2] for mb in minibatches]
        fields = FIELD_DTYPES | ({f: "float32" for f in mbatch.CRITIC_FIELDS} if self.cfg.algo.critic.enabled else {})
        several = len(minibatches) > 1
        if several:  # every mini-batch's proximal policy is the weights before the first update
            for j, (per_rank, count) in enumerate(plans):
                self._call("store_proximal", [(j, p, count, fields) for p in per_rank], what="train_step")
        for j, (per_rank, count) in enumerate(plans):
            key = j if several else None
            out = self._call("train_minibatch", [(p, count, fields, key) for p in per_rank], what="train_step")
            results.append(out)
            self._version = out[0].version
        seconds = time.perf_counter() - t0
        return StepResult(version=self._version, metrics=self._step_metrics(results, seconds))

    def _step_metrics(self, results: list[list[RankStepResult]], seconds: float) -> dict[str, float]:
        metrics = combine_minibatch_metrics([merge_metrics([r.metrics for r in out]) for out in results])
        flat = [r for out in results for r in out]
        tokens = sum(r.tokens for r in flat)
        padded = sum(r.padded_tokens for r in flat)
        metrics.update(
            {
                "learner/grad_norm": float(np.mean([out[0].grad_norm for out in results])),
                "learner/lr": float(results[-1][0].lr),
                "learner/train_tokens": float(tokens),
                "learner/microbatches": float(np.mean([out[0].microbatches for out in results])),
                "learner/padding_microbatches": float(sum(r.padding_microbatches for r in flat)),
                "learner/padding_frac": 1.0 - tokens / padded if padded else 0.0,
                "throughput/train_tokens_per_s": tokens / max(seconds, 1e-9),
                "time/learner_step": seconds,
                # Slowest rank per phase: the others wait for it at the next collective.
                "time/learner_prepass": sum(max(r.seconds_prepass for r in out) for out in results),
                "time/learner_forward_backward": sum(max(r.seconds_forward_backward for r in out) for out in results),
                "time/learner_optimizer": sum(max(r.seconds_optimizer for r in out) for out in results),
            }
        )
        return metrics

    def compute_logprobs(self, sequences: list[TrainSequence], temperature: float) -> list[np.ndarray]:
        """log p(input_ids[t] | input_ids[:t]) at `temperature` per sequence (position 0 is 0),
        under the config's rollout.top_k / top_p: -inf where a token lies outside the kept set
        (a prompt token often does)."""
        if not sequences:
            return []
        seqs = [mbatch.forward_fields(s) for s in sequences]  # a vision model's images too
        per_rank, count, origin = self._plan(seqs)
        out = self._call("logprobs", [(p, count, temperature) for p in per_rank])
        result: list[np.ndarray | None] = [None] * len(sequences)
        for rank_out, rank_origin in zip(out, origin, strict=True):
            # A rank pads its plan up to the common count; the padding micro-batches return no rows.
            for mb_out, mb_origin in zip(rank_out, rank_origin, strict=False):
                for arr, i in zip(mb_out, mb_origin, strict=True):
                    result[i] = arr
        return result  # type: ignore[return-value]

    # ------------------------------------------------------------------ weights & checkpoints

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Full state dict (HF names, CPU) gathered on rank 0; its version is `self.version`.
        Ships every tensor through Ray: for weight sync prefer export_to_file."""
        return self._call("full_state")[0]

    def export_to_file(self, path: str, full: bool = False) -> tuple[str, int]:
        """Rank 0 writes what a publish sends to `path` as safetensors (metadata: version): the
        full weights, or a LoRA run's adapter alone; ``full``: the full weights always."""
        versions = self._call("write_weights", [(str(path), full)] * self.num_ranks)
        if isinstance(versions[0], str):
            raise OSError(f"learner rank 0 could not write the weights to {path}: {versions[0]}")
        return str(path), int(versions[0])

    def export_to_object(self, location: WeightsObject) -> int:
        """The full weights as a Ray object (sync.backend=object_store), taken by the weight sync
        with ``take_export(location)``; returns their version. Rank 0's task returns the object,
        so the bytes stay in the object store of rank 0's node until a generator pulls them."""
        pairs = [a.export_blob.options(num_returns=2).remote() for a in self.actors]
        versions = self._gather([v for v, _ in pairs], "export")
        self._exports = {location: pairs[0][1]}  # one in flight: older ones are not needed
        return int(versions[0])

    def take_export(self, location: WeightsObject) -> Any:
        """The Ray object ``export_to_object(location)`` made (once), or None."""
        return getattr(self, "_exports", {}).pop(location, None)

    def save_checkpoint(self, dir: str, extra: dict[str, Any] | None = None) -> RunPath:
        """DCP model + optimizer shards, scheduler, RNG, step and version, plus `extra`; atomic.
        Returns the checkpoint: `dir`, or a new revision of it when its step was saved before."""
        final = run_path(dir, self.cfg.control.storage_options)
        staging = checkpoint.staging_dir(final)
        try:
            self._call("save", [(str(staging),)] * self.num_ranks, what="save_checkpoint")
            return checkpoint.publish(staging, final, dict(extra or {}))
        except BaseException:
            if staging != final:  # on an object store a first save writes in place: its marker is missing
                remove_tree(staging)
            raise

    def load_checkpoint(self, dir: str) -> dict[str, Any]:
        """Restore from `dir` (or the checkpoint its `latest` pointer names); return its `extra`."""
        path = checkpoint.resolve(run_path(dir, self.cfg.control.storage_options))
        versions = self._call("load", [(str(path),)] * self.num_ranks, what="load_checkpoint")
        self._version = int(versions[0])
        return read_extra(path)

    def shutdown(self) -> None:
        """Leave the process group where possible, then kill every rank by handle."""
        import ray

        actors, self.actors = getattr(self, "actors", []), []
        if actors and not self._broken:
            try:
                ray.get([a.close.remote() for a in actors], timeout=10)
            except Exception as e:  # the actors are killed next either way
                log.warning("learner ranks did not leave the process group cleanly: %s", e)
        for a in actors:
            ray.kill(a, no_restart=True)
        placement.release(getattr(self, "_pg", None))
        self._pg = None
        if not self._broken:
            self._broken = "shut down"
