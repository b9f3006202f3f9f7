"""Reward models: a Hugging Face sequence-classification model as a reward, one Ray actor per
``rollout.rewards`` entry {model: DIR, ...}, shared by every generator of the run.

    handles = start_reward_models(cfg)          # the control plane, at bring-up: named actors
    wait_ready(handles)                         # loaded (a model that cannot load fails here)
    client = RewardModelClient(run, index, spec)            # in each generator (WeightedRewards)
    await client.score(prompts=["abc="], completions=["abc"])   # TRL's signature -> [reward]
    ray.get(handle.stats.remote())              # ServerStats: forward passes, batch sizes, seconds
    stop_reward_models(handles)                 # tear-down: their stats logged, actors killed

The reward, as TRL's RewardTrainer and OpenRLHF train them: a model with num_labels=1 and its
one logit is the reward, unnormalised. A classifier with several labels gives the probability
(softmax) of the label ``spec.label`` names. The input is the chat the policy saw, the prompt
as the user's turn and the completion as the assistant's, rendered with the reward model's own
chat template when its tokenizer has one (and then tokenized without adding special tokens
again, since the template writes them); without a template, prompt + completion as plain text.
Inputs are right-padded (the model picks each row's last non-pad token, and position ids
stay those of the unpadded text), so a sample scores the same alone or in a batch.

Batching: each generator sends one request per sample (the scorer calls every reward per
sample, off its loop and under its timeout). The actor is an asyncio actor: requests queue on
its loop, and one batcher takes up to ``batch_size`` of them, waiting at most ``max_wait_ms``
for more once it has one, then runs a single forward pass (eval mode, no grad) on a thread of
its own, so requests keep queueing while it runs and the next batch is ready when it ends.

Failures are the scorer's to count: a request past its timeout, an error, or an actor that
died all fail only their samples (rollout.reward_on_failure). Ray restarts a crashed actor
(``max_restarts``) and retries the requests it was running (TASK_RETRIES). The actors are the
driver's (not detached): they end with the run, or at tear-down. Named in the NAMESPACE
namespace, so a generator in another Ray job of the cluster (``asyncrl generate
--ray-address``) finds them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.config import Config
from asyncrl.config.reward_model import RewardModelConfig, read_reward_model
from asyncrl.infra import ExpectedFailure

log = logging.getLogger(__name__)

NAMESPACE = "asyncrl"
TASK_RETRIES = 2
"""Times a request is retried on a restarted actor: a request whose batch crashes the actor
each time (a giant input running it out of memory) fails rather than crash it for ever."""
READY_TIMEOUT_S = 900.0


class RewardModelUnavailable(RuntimeError, ExpectedFailure):
    """A reward model's actor could not be started, or cannot be reached from here."""

    label = "reward model error"


def actor_name(run: str, index: int) -> str:
    return f"{run}/reward-model-{index}"


def format_input(tokenizer, prompt: str, completion: str) -> tuple[str, bool]:
    """The text the reward model scores and whether it already holds the special tokens: the
    chat (user prompt, assistant completion) in the tokenizer's own template when it has one,
    else prompt + completion."""
    if getattr(tokenizer, "chat_template", None):
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return tokenizer.apply_chat_template(chat, tokenize=False), True
    return prompt + completion, False


@dataclass
class ServerStats:
    requests: int = 0
    samples: int = 0
    forwards: int = 0
    forward_s: float = 0.0
    """Seconds in forward passes (tokenization included)."""
    batch_sizes: Counter = field(default_factory=Counter)
    """Forward passes by the number of samples in them."""
    failed_forwards: int = 0

    def describe(self) -> str:
        if not self.forwards:
            return f"{self.requests} requests, no forward pass"
        mean = self.samples / self.forwards
        return (
            f"{self.samples} samples in {self.forwards} forward passes (mean batch {mean:.1f}, "
            f"largest {max(self.batch_sizes)}), {1000 * self.forward_s / self.forwards:.1f} ms per pass"
        )


class RewardModelServer:
    """The Ray actor: one reward model, batching score requests from every generator."""

    def __init__(self, spec: RewardModelConfig, where: str):
        # torch and transformers: imported in the actor, not with this module (start-up imports it).
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.spec, self.where = spec, where
        self.info = read_reward_model(where, spec)
        torch.set_num_threads(max(1, int(spec.num_cpus)))
        self.device = "cuda" if spec.num_gpus > 0 else "cpu"
        tokenizer = AutoTokenizer.from_pretrained(spec.model)
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"  # a long input keeps the completion's end, which is judged
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ValueError(f"{where}.model={spec.model!r}: its tokenizer has neither a pad nor an eos token")
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(spec.model, dtype=getattr(torch, spec.dtype))
        if model.config.pad_token_id is None:  # it finds each row's last token by the pad id
            model.config.pad_token_id = tokenizer.pad_token_id
        self.tokenizer, self.model = tokenizer, model.to(self.device).eval()
        params = inspect.signature(model.forward).parameters.values()
        # Only the inputs forward() names: a tokenizer may add token_type_ids a decoder has no use for.
        self.inputs = {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}
        self.stats_ = ServerStats()
        self._queue: asyncio.Queue | None = None
        self._batcher: asyncio.Task | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="reward-model")

    def ready(self) -> str:
        chat = "its chat template" if getattr(self.tokenizer, "chat_template", None) else "plain text"
        return f"{self.spec.model}: {self.info.describe()}, on {self.device}, inputs as {chat}"

    def stats(self) -> ServerStats:
        return self.stats_

    def forward(self, prompts: list[str], completions: list[str]) -> list[float]:
        """Rewards of a batch in one forward pass (what a batch of requests runs)."""
        import torch

        formatted = [format_input(self.tokenizer, p, c) for p, c in zip(prompts, completions, strict=True)]
        enc = self.tokenizer(
            [text for text, _ in formatted],
            padding=True,
            truncation=self.spec.max_length is not None,
            max_length=self.spec.max_length,
            add_special_tokens=not any(templated for _, templated in formatted),
            return_tensors="pt",
        )
        batch = {k: v.to(self.device) for k, v in enc.items() if k in self.inputs}
        with torch.no_grad():
            logits = self.model(**batch).logits.float()
        if self.info.label_index is None:
            return logits[:, 0].tolist()
        return logits.softmax(-1)[:, self.info.label_index].tolist()

    async def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        """One reward per (prompt, completion), from the batch it joins."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        loop = asyncio.get_running_loop()
        if self._queue is None or self._batcher is None or self._batcher.done():
            self._queue = asyncio.Queue()  # on the actor's loop, which exists only once a call runs
            self._batcher = loop.create_task(self._batches())
        futures = [loop.create_future() for _ in prompts]
        for item in zip(prompts, completions, futures, strict=True):
            self._queue.put_nowait(item)
        self.stats_.requests += 1
        return list(await asyncio.gather(*futures))

    async def _batches(self) -> None:
        assert self._queue is not None
        queue, loop = self._queue, asyncio.get_running_loop()
        size, wait_s = self.spec.batch_size, self.spec.max_wait_ms / 1000
        while True:
            batch = [await queue.get()]
            deadline = loop.time() + wait_s
            while len(batch) < size:
                if not queue.empty():
                    batch.append(queue.get_nowait())
                    continue
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(queue.get(), left))
                except TimeoutError:
                    break
            batch = [item for item in batch if not item[2].done()]  # the caller went away
            if batch:
                await self._run(batch)

    async def _run(self, batch: list[tuple[str, str, asyncio.Future]]) -> None:
        t0 = time.perf_counter()
        prompts, completions = [p for p, _, _ in batch], [c for _, c, _ in batch]
        try:
            values = await asyncio.get_running_loop().run_in_executor(self._thread, self.forward, prompts, completions)
        except Exception as e:  # the batch's samples fail (counted by their scorers); the actor goes on
            self.stats_.failed_forwards += 1
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        s = self.stats_
        s.forwards, s.samples = s.forwards + 1, s.samples + len(batch)
        s.forward_s += time.perf_counter() - t0
        s.batch_sizes[len(batch)] += 1
        for (*_, fut), value in zip(batch, values, strict=True):
            if not fut.done():
                fut.set_result(value)


class RewardModelClient:
    """A generator's (or the evaluator's) side of one reward model: finds the run's actor by
    name on first use, then awaits its score per call (the scorer applies the timeout)."""

    def __init__(self, run: str | None, index: int):
        self.where = f"rollout.rewards[{index}]"
        self.name = actor_name(run, index) if run is not None else None
        self._handle: Any = None

    def _lookup(self) -> Any:
        import ray

        if self.name is None:
            raise RewardModelUnavailable(f"{self.where}: a reward model is scored only inside a run")
        if not ray.is_initialized():
            raise RewardModelUnavailable(
                f"{self.where}: the reward model's actor lives in the job's Ray cluster and this process is not "
                f"attached to it (`asyncrl generate --ray-address ...` attaches an elastic generator)"
            )
        try:
            return ray.get_actor(self.name, namespace=NAMESPACE)
        except ValueError:
            raise RewardModelUnavailable(
                f"{self.where}: no reward model actor {self.name!r} in the Ray cluster (its trainer starts it)"
            ) from None

    async def score(self, prompts: list[str], completions: list[str], **_columns: Any) -> list[float]:
        from ray.exceptions import ActorDiedError

        if self._handle is None:
            self._handle = await asyncio.to_thread(self._lookup)
        try:
            return await self._handle.score.remote(list(prompts), list(completions))
        except ActorDiedError:
            # Gone for good (restarts used up, or its run's trainer ended): a trainer that
            # comes back names a new actor, which the next call looks up.
            self._handle = None
            raise


def reward_models(cfg: Config) -> list[tuple[int, RewardModelConfig]]:
    return [(i, spec) for i, spec in enumerate(cfg.rollout.rewards) if isinstance(spec, RewardModelConfig)]


def start_reward_models(cfg: Config) -> list[tuple[str, Any]]:
    """Create one actor per reward model of ``cfg`` without waiting for them to load: [(where, handle)]."""
    started = []
    for i, spec in reward_models(cfg):
        actor = scorer_actor(RewardModelServer, actor_name(cfg.control.run_name, i), spec)
        where = f"rollout.rewards[{i}]"
        started.append((where, actor.remote(spec, where)))
    return started


class ScorerResources(Protocol):
    """What a scorer's config section asks of Ray (RewardModelConfig, TeacherConfig)."""

    num_cpus: float
    num_gpus: float
    max_restarts: int


def scorer_actor(cls: type, name: str, spec: ScorerResources) -> Any:
    """``cls`` as the run's named scorer actor class (a reward model, the teacher), restarted by
    Ray with its in-flight request retried. A predecessor under ``name``, left by a driver that
    shares this Ray, is killed first."""
    import ray

    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        _wait_name_free(name)
    return ray.remote(cls).options(
        name=name,
        namespace=NAMESPACE,
        num_cpus=spec.num_cpus,
        num_gpus=spec.num_gpus,
        max_restarts=spec.max_restarts,
        max_task_retries=TASK_RETRIES,
        max_concurrency=1000,  # requests wait on its loop for their batch, not on a slot
    )


def _wait_name_free(name: str, timeout_s: float = 30.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)


def wait_ready(started: list[tuple[str, Any]], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until every reward model is loaded; RewardModelUnavailable naming the entry if one cannot."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    for where, handle in started:
        try:
            log.info("%s: %s", where, ray.get(handle.ready.remote(), timeout=timeout_s))
        except RayActorError as e:
            raise RewardModelUnavailable(f"{where}: its actor could not start: {e}") from None
        except GetTimeoutError:
            raise RewardModelUnavailable(
                f"{where}: its model was not loaded within {timeout_s:g} s (does the cluster have the "
                f"CPUs/GPUs its num_cpus/num_gpus ask for?)"
            ) from None


def stop_reward_models(started: list[tuple[str, Any]]) -> None:
    """Log what each reward model did, then end its actor."""
    import ray

    for where, handle in started:
        with contextlib.suppress(Exception):  # a dead actor has nothing to say; tear-down goes on
            log.info("reward model %s: %s", where, ray.get(handle.stats.remote(), timeout=30).describe())
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)
    started.clear()
