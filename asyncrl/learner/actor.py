"""LearnerActor: one FSDP2 rank. Holds the sharded model(s), optimizer and schedule; hands the
work to the plain functions in step.py / checkpoint.py. Made a Ray actor by LearnerGroup:

    actor = ray.remote(LearnerActor).options(...).remote(cfg, path, rank=0, world_size=2)
    addr, port = ray.get(rank0.rendezvous_point.remote())  # rank 0's node picks them
    ray.get([a.setup.remote(addr, port) for a in actors])   # all ranks at once: it is a rendezvous

Every method that touches the model is a collective, so the driver calls it on all ranks
together with the same number of micro-batches; micro-batches arrive as lists of per-sequence
numpy dicts (cheap to ship through Ray) and are collated here.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from asyncrl.config import Config, LoraConfig, parse_cpu_list
from asyncrl.data import microbatch as mbatch
from asyncrl.data.tokens import sampleable_ids
from asyncrl.learner import checkpoint, fsdp, hf_format, lora, loss, optim, step
from asyncrl.learner.context_parallel import ContextParallel
from asyncrl.learner.critic import Critic
from asyncrl.learner.placement import rendezvous_point
from asyncrl.learner.result import RankStepResult
from asyncrl.learner.routing_replay import attach_replay, setup_replay
from asyncrl.seeding import learner_seed
from asyncrl.sync.model_ship import local_model
from asyncrl.sync.objstore import weights_packet
from asyncrl.sync.shm import temp_beside
from asyncrl.sync.weight_sync import lora_publish


class LearnerActor:
    """One data-parallel rank. Construct cheaply; `setup()` joins the group and loads the model."""

    lora_cfg: LoraConfig | None = None
    """learner.lora (set by setup): None trains and publishes every weight."""
    lora_publish: str | None = None
    """What a LoRA run's publishes carry, "adapter" or "merged" (asyncrl.sync.weight_sync.lora_publish)."""

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        *,
        rank: int,
        world_size: int,
        sample_special_tokens: bool,
        collective_timeout_s: float = 300.0,
        model_package: dict | None = None,
    ) -> None:
        self.cfg, self.model_path, self.model_package = cfg, model_path, model_package
        self.sample_special_tokens = sample_special_tokens
        self.rank, self.world_size = rank, world_size
        self.collective_timeout_s = collective_timeout_s
        self.version = 0
        self.step_count = 0
        self._proximal: dict[int, list[torch.Tensor]] = {}
        self._proximal_values: dict[int, list[torch.Tensor]] = {}
        self.critic: Critic | None = None
        self.cp: ContextParallel | None = None  # setup() builds it when learner.context_parallel > 1
        self._routing_refusals: set[str] = set()

    def rendezvous_point(self) -> tuple[str, int]:
        return rendezvous_point()

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        import ray

        # A local model path of the driver's host may not exist on this node: unpack the copy
        # shipped through Ray's object store (model_package) instead.
        self.model_path = local_model(self.model_path, self.model_package)

        lc = self.cfg.learner
        cores = parse_cpu_list(lc.cpu_affinity)
        if cores:  # benchmarks keep learners and generators on disjoint cores
            os.sched_setaffinity(0, cores)
        # Ray sets OMP_NUM_THREADS from num_cpus; torch reads it only at start-up, so set it.
        torch.set_num_threads(max(1, round(lc.cpus_per_rank)))
        torch.manual_seed(learner_seed(self.cfg) + self.rank)
        np.random.seed(learner_seed(self.cfg) + self.rank)
        self.device = fsdp.pick_device(lc.gpus_per_rank)
        backend = fsdp.pick_backend(lc.backend, self.device)
        fsdp.init_distributed(
            rank=self.rank,
            world_size=self.world_size,
            master_addr=master_addr,
            master_port=master_port,
            backend=backend,
            timeout_s=self.collective_timeout_s,
        )
        mesh = fsdp.build_mesh(self.device, self.world_size)
        # The sampling settings: every logprob and entropy here is taken from the
        # distribution the engines sampled from (their temperature, top-k and top-p).
        self.sampling = loss.Sampling.of(self.cfg.rollout)
        # FSDP shards over every rank; a CP group's ranks hold the same micro-batches and
        # their gradients add up to the whole row's (asyncrl.learner.context_parallel).
        if lc.context_parallel > 1:
            self.cp = ContextParallel.build(
                rank=self.rank, world_size=self.world_size, size=lc.context_parallel, sampling=self.sampling
            )
        loaded = fsdp.load_sharded_model(
            self.model_path,
            mesh,
            device=self.device,
            dtype=lc.dtype,
            activation_checkpointing=lc.activation_checkpointing,
            lora=lc.lora,
            context_parallel=lc.context_parallel,
        )
        self.lora_cfg, self.lora_publish = lc.lora, lora_publish(lc.lora, self.cfg.sync)
        # With LoRA, the HF model inside PEFT's wrappers (asyncrl.learner.lora).
        self.model: torch.nn.Module = loaded if lc.lora is None else cast(Any, loaded).base_model.model
        self.reference: Any = None
        if self.cfg.algo.kl_coef > 0 and lc.lora is not None:
            # The base weights are the model's own, under the adapters: no second copy.
            self.reference = lora.AdapterDisabled(self.model)
        elif self.cfg.algo.kl_coef > 0:
            self.reference = fsdp.load_sharded_model(
                self.model_path,
                mesh,
                device=self.device,
                dtype=lc.dtype,
                trainable=False,
                context_parallel=lc.context_parallel,
            )
        if self.cfg.algo.critic.enabled:  # its own module and optimizer: the policy's are untouched
            self.critic = Critic.load(self.cfg, self.model_path, mesh, device=self.device)
        if self.cfg.algo.routing_replay == "rollout":  # a model it cannot serve stops the run here
            setup_replay(self.model, context_parallel=lc.context_parallel)
        self.optimizer = optim.build_optimizer(self.model.parameters(), lc)
        total = self.cfg.control.total_steps * lc.mini_batches_per_step
        self.scheduler = optim.build_scheduler(self.optimizer, lc, total_steps=total)
        self.logprob_fn = self.sampling.logprob_fn()
        self.disallowed = self._disallowed_tokens()
        self.pad_token_id = mbatch.model_pad_token_id(cast(Any, self.model).config)  # an HF model under FSDP
        return {
            "rank": self.rank,
            "device": str(self.device),
            "backend": backend,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "threads": torch.get_num_threads(),
            "cores": sorted(os.sched_getaffinity(0)),
        }

    # ------------------------------------------------------------------ helpers

    def _disallowed_tokens(self) -> torch.Tensor | None:
        """The tokens the generators may not sample for this task, masked here as well."""
        from transformers import AutoTokenizer

        if self.sample_special_tokens:  # most tasks: no tokenizer to load
            return None
        allowed = sampleable_ids(AutoTokenizer.from_pretrained(self.model_path))
        # a HF PreTrainedModel's config; a vision-language model's vocabulary is its text config's
        vocab_size: int = self.model.config.get_text_config().vocab_size  # type: ignore[union-attr,operator]
        return step.disallowed_mask(allowed, vocab_size, self.device)

    def _microbatches(
        self, plan: list[list[dict[str, np.ndarray]]], count: int, fields: dict[str, str]
    ) -> list[dict[str, Any]]:
        mbs = self._collate(plan, count, fields)
        if self.cfg.algo.routing_replay == "rollout":  # a refused routing: that micro-batch routes itself
            attach_replay(self.model, mbs, logged=self._routing_refusals)
        return mbs

    def _collate(
        self, plan: list[list[dict[str, np.ndarray]]], count: int, fields: dict[str, str]
    ) -> list[dict[str, Any]]:
        flat = [seq for mb in plan for seq in mb]
        index, k = [], 0
        for mb in plan:
            index.append(list(range(k, k + len(mb))))
            k += len(mb)
        dtypes = {name: getattr(torch, dt) for name, dt in fields.items()}
        return mbatch.build_rank_microbatches(
            flat,
            index,
            count,
            dtypes,
            pad_token_id=self.pad_token_id,
            packing=self.cfg.learner.packing,
        )

    # ------------------------------------------------------------------ endpoints

    def store_proximal(
        self, key: int, plan: list[list[dict[str, np.ndarray]]], count: int, fields: dict[str, str]
    ) -> float:
        """Old (proximal) logprobs of a later mini-batch, taken now, before this step's first
        update: with several mini-batches per step they all share the step's starting policy."""
        t0 = time.perf_counter()
        mbs = self._microbatches(plan, count, fields)
        step.add_prepass_logprobs(
            self.model,
            None,
            mbs,
            temperature=self.cfg.rollout.temperature,
            logprob_fn=self.logprob_fn,
            device=self.device,
            disallowed=self.disallowed,
            cp=self.cp,
        )
        self._proximal[key] = [mb["old_logprobs"] for mb in mbs]
        if self.critic is not None:  # the critic's "old" values: before this step's first update too
            self._proximal_values[key] = self.critic.values(mbs)
        return time.perf_counter() - t0

    def train_minibatch(
        self,
        plan: list[list[dict[str, np.ndarray]]],
        count: int,
        fields: dict[str, str],
        proximal_key: int | None = None,
    ) -> RankStepResult:
        """Pre-pass (reference logprobs), then one optimizer step over `count` micro-batches.

        Old logprobs come from `store_proximal(proximal_key, ...)`, or, with no key (one
        mini-batch per step: the proximal policy is the current weights), from the training
        forward itself, detached, which saves a whole forward pass."""
        temperature = self.cfg.rollout.temperature
        t0 = time.perf_counter()
        mbs = self._microbatches(plan, count, fields)
        step.add_prepass_logprobs(
            None,
            self.reference,
            mbs,
            temperature=temperature,
            logprob_fn=self.logprob_fn,
            device=self.device,
            disallowed=self.disallowed,
            cp=self.cp,
        )
        if proximal_key is not None:
            for mb, old in zip(mbs, self._proximal.pop(proximal_key), strict=True):
                mb["old_logprobs"] = old
        critic_metrics = {}
        if self.critic is not None:  # GAE from the critic's values: the advantages the policy reads
            stored = self._proximal_values.pop(proximal_key) if proximal_key is not None else None
            critic_metrics = self.critic.prepare(mbs, stored if stored is not None else self.critic.values(mbs))
        t1 = time.perf_counter()

        loss_fn = loss.learner_loss_fn(
            self.cfg.algo,
            self.sampling,
            num_microbatches=count * self.world_size // (self.cp.size if self.cp else 1),
            old_from_current=proximal_key is None,
        )
        lc = self.cfg.learner
        with lora.dropout_active(self.model, lc.lora is not None and lc.lora.dropout > 0):
            stats = step.train_step(
                self.model,
                self.optimizer,
                self.scheduler,
                mbs,
                loss_fn,
                grad_clip=lc.grad_clip,
                device=self.device,
                disallowed=self.disallowed,
                cp=self.cp,
            )
        if self.critic is not None:
            critic_metrics |= self.critic.train(mbs)
        self.version += 1
        self.step_count += 1
        real = sum(mbatch.computed_tokens(mb) for mb in mbs if not mb[mbatch.PADDING_KEY])
        tokens = sum(len(s["input_ids"]) for p in plan for s in p)
        idle = count - len(plan)
        if self.cp is not None and self.cp.rank > 0:  # its group's first rank reports their micro-batches
            stats.metrics, real, tokens, idle = {}, 0, 0, 0
        return RankStepResult(
            metrics=stats.metrics | critic_metrics,
            grad_norm=stats.grad_norm,
            lr=stats.lr,
            version=self.version,
            tokens=tokens,
            padded_tokens=real,
            microbatches=count,
            padding_microbatches=idle,
            seconds_prepass=t1 - t0,
            seconds_forward_backward=stats.seconds_forward_backward,
            seconds_optimizer=stats.seconds_optimizer,
        )

    def logprobs(
        self, plan: list[list[dict[str, np.ndarray]]], count: int, temperature: float
    ) -> list[list[np.ndarray]]:
        mbs = self._microbatches(plan, count, {"input_ids": "int64"})
        lengths = [[len(s["input_ids"]) for s in mb] for mb in plan] + [[]] * (count - len(plan))
        return step.sequence_logprobs(
            self.model,
            mbs,
            lengths,
            temperature=temperature,
            logprob_fn=self.logprob_fn,
            device=self.device,
            disallowed=self.disallowed,
            cp=self.cp,
        )

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective; the full HF-named state dict on rank 0, {} on the others (a LoRA run's
        with its adapters merged in: the weights a model without LoRA loads)."""
        return self._weights(full=True)

    def _weights(self, full: bool) -> dict[str, torch.Tensor]:
        """Collective: what a publish sends (``full``: the full weights whatever it sends),
        on rank 0; {} on the others. A LoRA run publishes its adapter alone, or the merged
        weights (lora_publish); the adapter's gather leaves the frozen base where it is."""
        lc = self.lora_cfg
        if lc is not None and self.lora_publish == "adapter" and not full:
            return lora.adapter_state(self.model)
        state = fsdp.full_state_dict(self.model)
        if self.rank != 0:
            return {}
        if lc is not None:
            state = lora.merged_weights(state, lora.scale(lc))
        # In the names and layout the engines' loaders read (fused experts split back, tied
        # copies as the engine's reload needs them), or for an export the checkpoint's, as
        # from_pretrained reads it: asyncrl.learner.hf_format.
        if full:
            return hf_format.checkpoint_format(self.model, state)
        return hf_format.engine_format(self.model, state)

    def write_weights(self, path: str, full: bool = False) -> int | str:
        """Collective; rank 0 writes safetensors to `path` (atomically): what a publish sends,
        or with ``full`` the full weights (an export). Returns the version, or on rank 0 the
        write's error as text: the collective is over by then, so a full disk is the caller's
        to wait out, not a reason to mark the group broken."""
        from safetensors.torch import save_file

        state = self._weights(full)
        if self.rank == 0:
            tmp: str | None = None
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = temp_beside(path)  # 0600, O_EXCL: see temp_beside
                os.close(fd)  # save_file opens the name itself; it is ours alone now
                save_file(
                    {k: v.contiguous() for k, v in state.items()},
                    tmp,
                    metadata={"format": "pt", "version": str(self.version)},
                )
                os.replace(tmp, path)
            except Exception as e:  # reported to the driver, which raises it
                if tmp is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)  # a partial file only holds the space the next attempt needs
                return f"{type(e).__name__}: {e}"
        return self.version

    def export_blob(self):
        """Collective; (version, TensorPacket of the weights) on rank 0, (version, None) elsewhere."""
        state = self._weights(full=False)
        return self.version, (weights_packet(state) if self.rank == 0 else None)

    def save(self, directory: str) -> int:
        checkpoint.save_rank_state(
            directory,
            self.model,
            self.optimizer,
            self.scheduler,
            rank=self.rank,
            step=self.step_count,
            version=self.version,
            storage_options=self.cfg.control.storage_options,
        )
        if self.critic is not None:
            self.critic.save(
                directory,
                rank=self.rank,
                step=self.step_count,
                version=self.version,
                storage_options=self.cfg.control.storage_options,
            )
        return self.version

    def load(self, directory: str) -> int:
        self.step_count, self.version = checkpoint.load_rank_state(
            directory,
            self.model,
            self.optimizer,
            self.scheduler,
            rank=self.rank,
            storage_options=self.cfg.control.storage_options,
        )
        if self.critic is not None:
            self.critic.load_state(directory, rank=self.rank, storage_options=self.cfg.control.storage_options)
        return self.version

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> int:
        """Renumber the current weights (a resume continuing past versions a crashed run used)."""
        self.version = int(version)
        return self.version

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
