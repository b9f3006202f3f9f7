"""Hugging Face folders out of a run: the `save_pretrained` layout (model.safetensors, config,
tokenizer, generation config) that `AutoModelForCausalLM.from_pretrained`, vLLM and the Hub take.

    export_live(learner, model_path, run_dir / "hf" / "final")   # from the learners, mid-run or at the end
    export_checkpoint(run_dir, step=120)                          # from a DCP checkpoint, no learners
                                                                  # (`asyncrl export RUN_DIR --step 120`)

The run writes `run_dir/hf/final` when it ends (finished or stopped) and `run_dir/hf/step_N`
every `control.export_every` steps. A folder is assembled under a temporary name and renamed
into place, so a reader never sees a half-written one. Weights are float32 as trained; the
config, tokenizer and generation config are the base model's (`rollout.model`).

With the run dir on an object store the folder is assembled in a local temporary directory
and uploaded file by file over the old one (no rename there: a reader during the upload may
see a mix); the live export then takes the weights from the learners through Ray, since
learner rank 0 may run on another node than this process.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.rundir import CHECKPOINTS_DIR, CONFIG_FILE, complete_checkpoints, private_files, step_of
from asyncrl.rundir.store import ObjectPath, RunPath, local_dir_for, remove_tree, run_path, upload_tree

HF_DIR = "hf"
WEIGHTS_FILE = "model.safetensors"
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.jinja", "chat_template.json")
"""A vision-language model's processor (image size, image tokens per image, the chat template
with its image placeholder), copied as the base model has them: without them transformers and
vLLM would build the processor's defaults, which expand an image into another number of tokens.
``chat_template.json`` is where checkpoints saved by older transformers (SmolVLM's) keep the
processor's chat template, the one that writes the image placeholder."""


def _stage(out: RunPath, fill) -> RunPath:
    """Let `fill(folder)` write a folder under a temporary name, then rename it to `out` (a reader
    never sees half of it; a re-export of the same step replaces it); on an object store it is
    filled in a local temporary directory and uploaded over the old one."""
    if isinstance(out, ObjectPath):
        with tempfile.TemporaryDirectory(prefix="asyncrl-export-") as tmp:
            staged = Path(tmp) / out.name
            _stage(staged, fill)
            remove_tree(out)
            upload_tree(staged, out)
        return out
    from asyncrl.learner.checkpoint import replace_dir  # the learner package: torch

    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        fill(stage)
        replace_dir(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out


def _assemble(out: RunPath, model_path: str, write_weights) -> RunPath:
    """An HF folder at `out`: `write_weights(file)` puts the weights in it; the config, tokenizer
    and generation config are the base model's."""

    def fill(stage: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        write_weights(stage / WEIGHTS_FILE)
        config = AutoConfig.from_pretrained(model_path)
        config.save_pretrained(stage)
        AutoTokenizer.from_pretrained(model_path).save_pretrained(stage)
        try:
            generation = GenerationConfig.from_pretrained(model_path)
        except OSError:  # the base model has none: the one its config implies
            generation = GenerationConfig.from_model_config(config)
        generation.save_pretrained(stage)
        for name in PROCESSOR_FILES:
            if (Path(model_path) / name).is_file() and not (stage / name).exists():
                shutil.copyfile(Path(model_path) / name, stage / name)

    return _stage(out, fill)


def export_live(learner, model_path: str, out: str | Path | RunPath) -> RunPath:
    """The learners' current weights (rank 0 gathers and writes them) as an HF folder at `out`."""
    out = run_path(out)
    if isinstance(out, ObjectPath):
        return _assemble(out, model_path, lambda file: _save_weights(learner.export_state_dict(), file, {}))
    return _assemble(out, model_path, lambda file: learner.export_to_file(str(file), full=True))


def _save_weights(state, file: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    # Tied weights are one tensor under two names: safetensors stores each name's own copy.
    save_file(
        {k: v.detach().clone().contiguous() for k, v in state.items()},
        str(file),
        metadata={"format": "pt", **metadata},
    )


def checkpoint_dir(run_dir: str | Path | RunPath, step: int | None = None) -> RunPath:
    """The complete checkpoint of `step` in the run, or its latest; FileNotFoundError naming what exists."""
    root = run_path(run_dir) / CHECKPOINTS_DIR
    done = complete_checkpoints(root)
    if not done:
        raise FileNotFoundError(f"{root}: no complete checkpoint to export")
    if step is None:
        return done[-1]
    of_step = [p for p in done if step_of(p) == step]  # the newest save of it, if it was saved again
    if not of_step:
        have = ", ".join(str(step_of(p)) for p in done)
        raise FileNotFoundError(f"{root}: no complete checkpoint of step {step} (there are: {have})")
    return of_step[-1]


def export_checkpoint(
    run_dir: str | Path | RunPath,
    step: int | None = None,
    out: str | Path | RunPath | None = None,
    *,
    adapter: bool = False,
) -> RunPath:
    """An HF folder from a run's DCP checkpoint (default: the latest), read in this process with
    no learner or process group; written to `out` or ``run_dir/hf/step_N``. A URL is read with
    its filesystem's standard credentials (asyncrl.rundir.store.run_path). A LoRA run's
    checkpoint holds only its adapter: it is loaded onto the base model and merged, or with
    ``adapter`` written alone in PEFT's format (``run_dir/hf/step_N-adapter`` by default). A
    checkpoint with a PPO critic also gives the critic's folder beside it (``<out>-critic``).

    A run dir, step or --adapter it cannot export is refused before torch and transformers are
    imported (seconds of start-up): a mistyped step fails at once."""
    run_dir = run_path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    ckpt = checkpoint_dir(run_dir, step)
    cfg = load_config(run_dir / CONFIG_FILE)
    lora = cfg.learner.lora
    if adapter and lora is None:
        raise ValueError(f"{run_dir}: --adapter needs a LoRA run (its config has no learner.lora)")

    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from asyncrl.control.runtime import resolve_model
    from asyncrl.learner.checkpoint import dcp_storage
    from asyncrl.learner.critic import CRITIC_DIR

    n = step_of(ckpt)
    target = run_path(out, getattr(run_dir, "storage_options", None)) if out is not None else None
    policy_out = target or run_dir / HF_DIR / (f"step_{n}-adapter" if adapter else f"step_{n}")
    model_path = resolve_model(cfg, local_dir_for(run_dir, cfg.control.local_dir))
    if (ckpt / CRITIC_DIR / "dcp").exists():
        with private_files(cfg.control.private_files):
            export_critic(cfg, ckpt, model_path, policy_out.parent / f"{policy_out.name}-critic")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if lora is not None:
        return _export_lora(model, cfg, ckpt, model_path, policy_out, adapter)
    state = model.state_dict()
    # The checkpoint holds {"model", "optim"}; only the model's entries are asked for.
    dcp.load({"model": state}, **dcp_storage(ckpt, reader=True))

    def write(file: Path) -> None:
        from asyncrl.learner.hf_format import checkpoint_format

        _save_weights(checkpoint_format(model, state), file, {"step": str(n)})

    with private_files(cfg.control.private_files):  # as private as the run's own exports
        return _assemble(policy_out, model_path, write)


def export_critic(cfg, ckpt: RunPath, model_path: str, out: RunPath) -> RunPath:
    """A checkpoint's PPO critic (``<checkpoint>/critic``) as an HF folder at ``out``: the value
    model as ``*ForTokenClassification`` with one label, which ``algo.critic.model`` takes back
    (a later run's critic starts from it) and transformers loads as any such model."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    from asyncrl.learner.checkpoint import dcp_storage
    from asyncrl.learner.critic import CRITIC_DIR

    source = cfg.algo.critic.model or model_path  # the architecture it was built from
    config = AutoConfig.from_pretrained(source)
    config.num_labels = 1
    model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    state = model.state_dict()
    dcp.load({"model": state}, **dcp_storage(ckpt / CRITIC_DIR, reader=True))
    model.load_state_dict(state)

    def fill(stage: Path) -> None:
        model.save_pretrained(stage)
        AutoTokenizer.from_pretrained(model_path).save_pretrained(stage)

    return _stage(out, fill)


def _export_lora(model, cfg, ckpt: RunPath, model_path: str, out: RunPath, adapter: bool) -> RunPath:
    """The checkpoint's adapter on ``model`` (the base): merged into an HF folder, or alone."""
    import torch.distributed.checkpoint as dcp

    from asyncrl.learner.checkpoint import dcp_storage
    from asyncrl.learner.lora import apply_lora, is_adapter

    peft_model = apply_lora(model, cfg.learner.lora, model_path)
    inner = peft_model.base_model.model  # the names the learner checkpointed (asyncrl.learner.lora)
    state = {k: v for k, v in inner.state_dict().items() if is_adapter(k)}
    dcp.load({"model": state}, **dcp_storage(ckpt, reader=True))
    inner.load_state_dict(state, strict=False)
    with private_files(cfg.control.private_files):
        if adapter:
            return _stage(out, lambda stage: peft_model.save_pretrained(str(stage)))
        merged = peft_model.merge_and_unload()

        def write(file: Path) -> None:
            merged.save_pretrained(str(file.parent))

        return _assemble(out, model_path, write)
