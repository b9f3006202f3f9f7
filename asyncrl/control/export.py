"""Hugging Face folders out of a run: the `save_pretrained` layout (model.safetensors, config,
tokenizer, generation config) that `AutoModelForCausalLM.from_pretrained`, vLLM and the Hub take.

    export_live(learner, model_path, run_dir / "hf" / "final")   # from the learners, mid-run or at the end
    export_checkpoint(run_dir, step=120)                          # from a DCP checkpoint, no learners
                                                                  # (`asyncrl export RUN_DIR --step 120`)

The run writes `run_dir/hf/final` when it ends (finished or stopped) and `run_dir/hf/step_N`
every `control.export_every` steps. A folder is assembled under a temporary name and renamed
into place, so a reader never sees a half-written one. Weights are float32 as trained; the
config, tokenizer and generation config are the base model's (`rollout.model`).
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.control.runtime import resolve_model
from asyncrl.learner.checkpoint import replace_dir
from asyncrl.rundir import CHECKPOINTS_DIR, CONFIG_FILE, complete_checkpoints, private_files, step_of

HF_DIR = "hf"
WEIGHTS_FILE = "model.safetensors"


def _assemble(out: Path, model_path: str, write_weights) -> Path:
    """Stage a folder, let `write_weights(file)` put the weights in it, add the rest, rename it to `out`."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        write_weights(stage / WEIGHTS_FILE)
        config = AutoConfig.from_pretrained(model_path)
        config.save_pretrained(stage)
        AutoTokenizer.from_pretrained(model_path).save_pretrained(stage)
        try:
            generation = GenerationConfig.from_pretrained(model_path)
        except OSError:  # the base model has none: the one its config implies
            generation = GenerationConfig.from_model_config(config)
        generation.save_pretrained(stage)
        replace_dir(stage, out)  # a re-export of the same step replaces it
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out


def export_live(learner, model_path: str, out: str | Path) -> Path:
    """The learners' current weights (rank 0 gathers and writes them) as an HF folder at `out`."""
    return _assemble(Path(out), model_path, lambda file: learner.export_to_file(str(file), full=True))


def checkpoint_dir(run_dir: str | Path, step: int | None = None) -> Path:
    """The complete checkpoint of `step` in the run, or its latest; FileNotFoundError naming what exists."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    done = complete_checkpoints(root)
    if not done:
        raise FileNotFoundError(f"{root}: no complete checkpoint to export")
    if step is None:
        return done[-1]
    path = root / f"step_{step:06d}"
    if path not in done:
        have = ", ".join(str(step_of(p)) for p in done)
        raise FileNotFoundError(f"{root}: no complete checkpoint of step {step} (there are: {have})")
    return path


def export_checkpoint(
    run_dir: str | Path, step: int | None = None, out: str | Path | None = None, *, adapter: bool = False
) -> Path:
    """An HF folder from a run's DCP checkpoint (default: the latest), read in this process with
    no learner or process group; written to `out` or ``run_dir/hf/step_N``. A LoRA run's
    checkpoint holds only its adapter: it is loaded onto the base model and merged, or with
    ``adapter`` written alone in PEFT's format (``run_dir/hf/step_N-adapter`` by default)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    ckpt = checkpoint_dir(run_dir, step)
    cfg = load_config(run_dir / CONFIG_FILE)
    lora = cfg.learner.lora
    if adapter and lora is None:
        raise ValueError(f"{run_dir}: --adapter needs a LoRA run (its config has no learner.lora)")
    model_path = resolve_model(cfg, run_dir)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    n = step_of(ckpt)
    if lora is not None:
        suffix = "-adapter" if adapter else ""
        return _export_lora(model, cfg, ckpt, model_path, out or run_dir / HF_DIR / f"step_{n}{suffix}", adapter)
    state = model.state_dict()
    # The checkpoint holds {"model", "optim"}; only the model's entries are asked for.
    dcp.load({"model": state}, checkpoint_id=str(ckpt / "dcp"))

    def write(file: Path) -> None:
        # Tied weights are one tensor under two names: safetensors stores each name's own copy.
        save_file(
            {k: v.detach().clone().contiguous() for k, v in state.items()},
            str(file),
            metadata={"format": "pt", "step": str(n)},
        )

    with private_files(cfg.control.private_files):  # as private as the run's own exports
        return _assemble(Path(out) if out is not None else run_dir / HF_DIR / f"step_{n}", model_path, write)


def _export_lora(model, cfg, ckpt: Path, model_path: str, out: str | Path, adapter: bool) -> Path:
    """The checkpoint's adapter on ``model`` (the base): merged into an HF folder, or alone."""
    import torch.distributed.checkpoint as dcp

    from asyncrl.learner.lora import apply_lora, is_adapter

    peft_model = apply_lora(model, cfg.learner.lora, model_path)
    inner = peft_model.base_model.model  # the names the learner checkpointed (asyncrl.learner.lora)
    state = {k: v for k, v in inner.state_dict().items() if is_adapter(k)}
    dcp.load({"model": state}, checkpoint_id=str(ckpt / "dcp"))
    inner.load_state_dict(state, strict=False)
    out = Path(out)
    with private_files(cfg.control.private_files):
        if adapter:
            return _stage_and_replace(out, lambda stage: peft_model.save_pretrained(str(stage)))
        merged = peft_model.merge_and_unload()

        def write(file: Path) -> None:
            merged.save_pretrained(str(file.parent))

        return _assemble(out, model_path, write)


def _stage_and_replace(out: Path, write) -> Path:
    """Stage a folder, let `write(stage)` fill it, rename it to `out` (a reader never sees half)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        write(stage)
        replace_dir(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out
