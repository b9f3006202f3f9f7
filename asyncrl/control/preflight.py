"""`asyncrl train --check`: what can be checked before anything starts, on any host.

    lines = preflight(cfg)      # [str] to print; ConfigError when something would fail at start-up

Past the config schema (asyncrl.config), the run's pieces are resolved the way the runtime
resolves them, with the same code and so the same messages, without a model download, Redis,
Ray or a device:
- every import path the config names: the environment (built with its env_kwargs, and asked
  for a prompt when it makes them), the reward functions, a custom policy loss or advantage
  estimator;
- every prompt source a run reads, through to the end (a hub dataset's first HUB_SAMPLE
  records, as the output says), each record split and validated as a generator would; with
  rollout.chat_template and a local model, that its tokenizer has a usable template;
- a run dir on an object store (control.run_dir a URL): that this host can write there;
- rollout.model: a local directory's config, weights and tokenizer, a hub id's form (and, where
  the hub answers, that it exists: asyncrl.control.preflight_model);
- the weight-sync backend (``auto`` as this host would run it), the vLLM engine arguments a
  generator builds (unknown ``rollout.engine_kwargs`` are rejected here, and a nccl sync needs
  engines built with vLLM's nccl weight transfer), the sync directory.
What needs CUDA is listed, and whether this host has it: a GPU config checked on a CPU box
passes up to that point and says so (a hub dataset this host cannot reach, likewise).
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
from pathlib import Path

from asyncrl.config import Config, ConfigError
from asyncrl.config.attention_rules import check_context_parallel
from asyncrl.config.base import is_hub_id
from asyncrl.config.reward_model import RewardModelConfig, read_reward_model
from asyncrl.control.preflight_gpu import cuda_devices, gpu_fit
from asyncrl.control.preflight_model import check_model, hub_offline_if_unreachable
from asyncrl.data.images import IMAGES_KEY, ImageLimits
from asyncrl.rollout import families
from asyncrl.rollout.envs.chat import check_turn_template
from asyncrl.rollout.envs.reward_fns import make_rollout_env
from asyncrl.rollout.prompts import PromptSourceError, SourceCheck, check_chat_template, check_source
from asyncrl.rollout.sampling import check_routing_replay, engine_args, transfer_backend
from asyncrl.rollout.vision_prompts import describe_images, images_refused
from asyncrl.rundir.store import StorageError, check_writable, is_url, run_path
from asyncrl.seeding import rollout_seed
from asyncrl.sync.nccl import NcclWeightSync
from asyncrl.sync.objstore import ObjectStoreWeightSync
from asyncrl.sync.shm import ShmWeightSync
from asyncrl.sync.weight_sync import WeightSync, resolve_backend

HUB_SAMPLE = 1000
"""A hub dataset's records --check reads (the whole split may be large); stated in its output."""


def preflight(cfg: Config) -> list[str]:
    # vLLM's own INFO lines (its Triton probing on a CPU host) are not --check's business: muted
    # as in a run's workers (asyncrl.control.bringup), unless debug logging is on.
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        logging.getLogger("vllm").setLevel(logging.WARNING)
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)  # "no CPU backend": expected
    # A host that cannot reach the hub is checked offline: one line, not a minute of retries.
    offline = hub_offline_if_unreachable(hub_ids(cfg))
    # The user's inputs first: they need no torch (a custom loss aside) and fail in a second.
    lines = [*offline, *check_prompt_sources(cfg), *check_imports(cfg), *check_run_dir(cfg)]
    import torch  # for CUDA below; loaded here, not with --check's modules

    s, r, learner = cfg.sync, cfg.rollout, cfg.learner
    backend = resolve_backend(s.backend)
    where = "" if s.backend != "auto" else " (sync.backend=auto on this host; another node may differ)"
    lines.append(f"weight sync: {backend}{where}")
    if not os.path.isdir(s.shm_dir):
        raise ConfigError(f"sync.shm_dir={s.shm_dir!r}: not a directory (every backend writes weights there)")
    cls = _sync_class(backend)
    if not issubclass(cls, WeightSync):
        raise ConfigError(f"sync.backend={backend!r}: {cls.__name__} does not implement WeightSync")

    try:  # the generators' engine platform, as a run's start-up refuses it (asyncrl.control.train)
        check_routing_replay(cfg.algo.routing_replay, r, cfg.control.ray_address, learner.context_parallel)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model_line = check_model(r.model)
    model = "tiny-model" if r.model == "tiny" else r.model
    # The engine reads nothing here, but with HF_HUB_OFFLINE vLLM's engine arguments look a
    # model that is not a path up in the local cache: an existing stand-in keeps that out.
    stand_in = model if os.path.exists(model) else tempfile.gettempdir()
    try:
        args = engine_args(r, stand_in, rollout_seed(cfg), transfer_backend(s), learner_dtype=learner.dtype)
    except TypeError as e:
        raise ConfigError(f"rollout.engine_kwargs={r.engine_kwargs!r}: vLLM's AsyncEngineArgs refuses it: {e}") from e
    transfer = getattr(args.weight_transfer_config, "backend", None)
    if backend == "nccl" and transfer != "nccl":
        raise ConfigError(
            f"sync.backend=nccl needs engines built with vLLM's nccl weight transfer; "
            f"rollout.engine_kwargs sets weight_transfer_config={args.weight_transfer_config!r}"
        )
    lines.append(f"engine: {model}, dtype {args.dtype}, weight_transfer_config {transfer or 'none'}")
    lines.append(model_line)
    lines.append(families.describe(r.model))
    check_context_parallel(repr(r.model), families.read_config(r.model), learner.context_parallel)
    families.check_vision_learner(
        r.model,
        families.read_config(r.model),
        critic=cfg.algo.critic.enabled,
        lora=learner.lora is not None,
        context_parallel=learner.context_parallel,
    )

    cuda = torch.cuda.is_available()
    needs = [
        what
        for what, needed in (
            ("sync.backend=nccl", backend == "nccl"),
            (f"learner.gpus_per_rank={learner.gpus_per_rank:g}", learner.gpus_per_rank > 0),
            (f"rollout.gpus_per_generator={r.gpus_per_generator:g}", r.gpus_per_generator > 0),
        )
        if needed
    ]
    if needs:
        state = "available" if cuda else "not available on this host: checked up to here"
        lines.append(f"needs CUDA: {', '.join(needs)} ({state})")
    lines += gpu_fit(cfg, backend, cuda_devices())
    return lines


def hub_ids(cfg: Config) -> list[str]:
    """The hub models and datasets a run would download: rollout.model when it is not a local
    directory, and every prompt source that is a hub id."""
    ids = [source for _, source, _ in prompt_sources(cfg) if is_hub_id(source)]
    model = cfg.rollout.model
    if model != "tiny" and not os.path.exists(os.path.expanduser(model)):
        ids.insert(0, model)
    return ids


def check_run_dir(cfg: Config) -> list[str]:
    """A run dir URL: its filesystem package is installed and a probe object can be written and
    deleted there (credentials, endpoint, bucket, permission). A local run dir is created at
    start-up, as before."""
    c = cfg.control
    if not is_url(c.run_dir):
        return []
    try:
        check_writable(run_path(c.run_dir, c.storage_options))
    except (StorageError, OSError) as e:
        raise ConfigError(f"control.run_dir={c.run_dir!r}: {e}") from None
    return [f"run dir: {c.run_dir} is writable"]


def _sync_class(backend: str) -> type:
    if backend == "nccl":
        return NcclWeightSync
    if backend == "object_store":
        return ObjectStoreWeightSync

    return ShmWeightSync


def _drawn_metadata(env: str, drawn: object) -> dict:
    """A drawn prompt's metadata; ValueError unless make_prompt gave (text, metadata dict), which
    every generator reads (``metadata.get``) and the record's codec requires."""
    if not (
        isinstance(drawn, (tuple, list))
        and len(drawn) == 2
        and isinstance(drawn[0], str)
        and isinstance(drawn[1], dict)
    ):
        what = (
            type(drawn).__name__
            if not isinstance(drawn, (tuple, list))
            else f"({', '.join(type(v).__name__ for v in drawn)})"
        )
        raise ValueError(f"rollout.env={env!r}: make_prompt returned {what}, expected (text: str, metadata: dict)")
    return drawn[1]


def check_imports(cfg: Config) -> list[str]:
    """Import and resolve every import path the config names, as generators and learners do."""
    r, algo = cfg.rollout, cfg.algo
    try:
        try:
            env = make_rollout_env(r)
            drawn = None if r.prompts else env.make_prompt(random.Random(0))
            metadata = {} if drawn is None else _drawn_metadata(r.env, drawn)
        except (ValueError, NotImplementedError):
            raise
        except Exception as e:  # the user's constructor or make_prompt: a generator would die of it
            raise ValueError(
                f"rollout.env={r.env!r}: building it or drawing a prompt raised {type(e).__name__}: {e}"
            ) from e
        # asyncrl.algo's registries import torch: resolved here, not when --check's modules load.
        from asyncrl.algo.advantages import get_advantage_estimator
        from asyncrl.algo.losses import get_policy_loss

        get_policy_loss(algo.policy_loss.type)
        get_advantage_estimator(algo.advantage_estimator)
    except (ValueError, NotImplementedError) as e:
        raise ConfigError(str(e)) from e
    lines = [f"rollout.env={r.env}: imported and built" + (" (makes the prompts)" if not r.prompts else "")]
    if drawn is not None:  # read and decoded as a generator will, and what its engine gets
        where = f"rollout.env={r.env}"
        refused = images_refused(r.env, env.multi_turn, r.teacher is not None)
        if refused is not None and IMAGES_KEY in metadata:
            raise ConfigError(f"{where}: a drawn prompt carries images, but {refused}")
        lines += describe_images(r.model, r.chat_template, drawn[0], metadata, where, ImageLimits.of(r.images))
    lines += [_reward_line(i, spec) for i, spec in enumerate(r.rewards)]
    if r.teacher is not None:
        from asyncrl.rollout.teacher import check_line

        lines.append(check_line(r.teacher, r.model))
    tools = getattr(env, "tools", None) if r.env == "tools" else None
    if tools:  # the tools env imported each tool and made its schema when it was built
        lines += [
            f"rollout.env_kwargs.tools: {t.path}: imported, {t.name}({', '.join(t.params)})" for t in tools.values()
        ]
    lines += [
        f"{field}={path}: imported"
        for field, path in (
            ("algo.policy_loss.type", algo.policy_loss.type),
            ("algo.advantage_estimator", algo.advantage_estimator),
        )
        if ":" in path
    ]
    return lines


def _reward_line(index: int, spec) -> str:
    """A reward function was imported above; a reward model's config and tokenizer are read
    here (its weights only by its actor)."""
    where = f"rollout.rewards[{index}]"
    if not isinstance(spec, RewardModelConfig):
        return f"{where}.fn={spec.fn}: imported"
    info = read_reward_model(where, spec)
    # transformers only here: --check must start without it.
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(spec.model)
    except Exception as e:  # whatever a broken tokenizer directory raises, the actor would die of it
        why = f"{type(e).__name__}: {e}"
        raise ConfigError(f"{where}.model={spec.model!r}: its tokenizer cannot be loaded: {why}") from e
    return f"{where}.model={spec.model}: {info.describe()}, tokenizer loaded"


def prompt_sources(cfg: Config) -> list[tuple[str, str, str]]:
    """(config key, source, split) of each prompt source a run reads: evaluation's only when
    it evaluates."""
    r, c = cfg.rollout, cfg.control
    sources = [("rollout.prompts", r.prompts, r.prompt_split)]
    if c.eval_every:
        sources.append(("control.eval_prompts", c.eval_prompts, c.eval_split))
    return [(where, source, split) for where, source, split in sources if source]


def check_prompt_source(cfg: Config, where: str, source: str, split: str, hub_sample: int | None = None) -> SourceCheck:
    """Read one of the run's prompt sources through as its generators would (PromptSourceError)."""
    r = cfg.rollout
    return check_source(
        source,
        split=split,
        prompt_field=r.prompt_field,
        answer_field=r.answer_field,
        chat_template=r.chat_template,
        where=where,
        hub_sample=hub_sample,
        image_limits=ImageLimits.of(r.images),
    )


def _source_image_lines(cfg: Config, found: SourceCheck) -> list[str]:
    """A prompt source's first record with images, rendered for rollout.model as a generator
    would (describe_images): refused for a text model, a multi-turn env or a teacher."""
    if found.first_with_images is None:
        return []
    r = cfg.rollout
    place, text, metadata = found.first_with_images
    try:
        multi_turn = make_rollout_env(r).multi_turn
    except Exception:  # the env's own failure: check_imports reports it with its reason
        multi_turn = False
    refused = images_refused(r.env, multi_turn, r.teacher is not None)
    if refused is not None:
        raise ConfigError(f"{place}: the record carries images, but {refused}")
    return describe_images(r.model, r.chat_template, text, metadata, place, ImageLimits.of(r.images))


def check_prompt_sources(cfg: Config) -> list[str]:
    """Read every prompt source a run reads (evaluation's only when it evaluates) and check each
    record; with rollout.chat_template and a local model, check its tokenizer has a template."""
    r = cfg.rollout
    lines = []
    try:
        for where, source, split in prompt_sources(cfg):
            try:
                found = check_prompt_source(cfg, where, source, split, hub_sample=HUB_SAMPLE)
            except PromptSourceError as e:
                # As CUDA: a cluster's config may be checked on a host that cannot reach the hub.
                if not isinstance(e.__cause__, ConnectionError):
                    raise
                lines.append(f"{where}={source}: not read, the hub is unreachable from this host ({e.__cause__})")
                continue
            lines.append(f"{where}={source}: {found.describe()}")
            lines += _source_image_lines(cfg, found)
        if r.chat_template and Path(r.model).is_dir():
            # transformers only here: --check must start without it, and only a local model's
            # tokenizer can be read without a download.
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(r.model)
            check_chat_template(tokenizer, r.model)
            check_turn_template(tokenizer, r.env, r.env_kwargs)
            lines.append(f"rollout.chat_template: {r.model}'s tokenizer has one")
        elif r.chat_template:
            lines.append(f"rollout.chat_template: not checked ({r.model} is not a local directory)")
    except PromptSourceError as e:
        raise ConfigError(str(e)) from e
    return lines
