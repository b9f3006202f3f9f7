"""Every tested model family checkpoints, resumes and exports through the learner's own code,
with no job: a one-rank gloo group in this process (the `mesh` fixture), each family's tiny
model loaded and sharded as a learner rank loads it (fsdp.load_sharded_model, FSDP2), trained
two optimizer steps so its weights are its own, then

- **checkpoint and resume**: ``LearnerActor.save`` into a staging directory published as the
  run's checkpoint (what LearnerGroup.save_checkpoint does), ``LearnerActor.load`` into a
  fresh learner on the base model: step, version, logits and one more step all equal (the
  optimizer's moments came back too);
- **HF export**: the live export (``export_live`` through ``LearnerActor.write_weights(full=True)``)
  and ``asyncrl export`` of the checkpoint (``export_checkpoint``) hold the checkpoint's names
  (the base model's file: tied copies dropped, fused experts split) and load back with plain
  transformers to the learner's logits.

The engine side of each family (publishes, parity with vLLM) is
tests/parity/test_model_matrix.py; the job-level crash and resume of Gemma 2 is there too.

    .venv/bin/python -m pytest tests/unit/test_family_checkpoints.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from asyncrl.config import Config, load_config
from asyncrl.learner import checkpoint, fsdp, optim
from asyncrl.learner.actor import LearnerActor
from asyncrl.rollout.families import TESTED
from asyncrl.rollout.tiny import write_tiny_model
from asyncrl.rundir import CHECKPOINTS_DIR, CONFIG_FILE

ARCHS = [arch for family in TESTED for arch in family.archs]
IDS = torch.tensor([[1, 5, 9, 14, 20, 7, 33, 12, 40, 6, 6, 21]])  # longer than the 4-token windows
LR = 1e-2  # large enough that two steps move every family's logits well past the tolerances below


def learner(cfg: Config, model_path: str, mesh) -> LearnerActor:
    """A learner rank as LearnerActor.setup builds it (its model, optimizer and schedule), on
    the `mesh` fixture's group instead of a Ray actor's own."""
    actor = LearnerActor(cfg, model_path, rank=0, world_size=1, sample_special_tokens=False)
    actor.model = fsdp.load_sharded_model(model_path, mesh, device=torch.device("cpu"), dtype="float32")
    actor.optimizer = optim.build_optimizer(actor.model.parameters(), cfg.learner)
    actor.scheduler = optim.build_scheduler(actor.optimizer, cfg.learner, total_steps=cfg.control.total_steps)
    return actor


def train_step(actor: LearnerActor) -> None:
    actor.optimizer.zero_grad(set_to_none=True)
    logits = actor.model(input_ids=IDS, use_cache=False).logits
    torch.log_softmax(logits, -1)[0, :-1].gather(-1, IDS[0, 1:, None]).sum().neg().backward()
    actor.optimizer.step()
    actor.scheduler.step()
    actor.step_count += 1
    actor.version += 1


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits.float()


class _Exporter:
    """LearnerGroup.export_to_file for one in-process rank."""

    def __init__(self, actor: LearnerActor) -> None:
        self.actor = actor

    def export_to_file(self, path: str, full: bool = False) -> tuple[str, int]:
        version = self.actor.write_weights(path, full)
        if isinstance(version, str):
            raise OSError(version)
        return path, version


def assert_loads_back(folder: Path, base: Path, want: torch.Tensor) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    assert sorted(load_file(str(folder / "model.safetensors"))) == sorted(load_file(str(base / "model.safetensors")))
    # Eager attention: transformers' reference for every rule a family has (its SDPA path
    # drops Gemma 2's soft-cap, see docs/guide/models.md).
    exported = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    exported.train(False)
    torch.testing.assert_close(logits_of(exported), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_family_checkpoints_resumes_and_exports(arch, mesh, tmp_path):
    from asyncrl.control.export import export_checkpoint, export_live

    base = write_tiny_model(tmp_path / "model", arch=arch, seed=0)
    run = tmp_path / "run"
    cfg = load_config(None, [f"rollout.model={base}", f"learner.lr={LR}", "control.total_steps=10"])
    (run / CHECKPOINTS_DIR).mkdir(parents=True)
    (run / CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    trained = learner(cfg, str(base), mesh)
    before = logits_of(trained.model)
    train_step(trained)
    train_step(trained)
    want = logits_of(trained.model)
    assert (want - before).abs().max() > 1e-2, f"{arch}: two steps at lr={LR} did not move the model"

    # The live export (what a run writes to hf/final), from the learner at step 2.
    assert_loads_back(export_live(_Exporter(trained), str(base), run / "hf" / "final"), base, want)

    final = run / CHECKPOINTS_DIR / "step_000002"
    staging = checkpoint.staging_dir(final)
    assert trained.save(str(staging)) == 2
    checkpoint.publish(staging, final, {})
    assert_loads_back(export_checkpoint(run, step=2), base, want)  # `asyncrl export RUN --step 2`

    resumed = learner(cfg, str(base), mesh)
    assert resumed.load(str(checkpoint.resolve(run / CHECKPOINTS_DIR))) == 2 and resumed.step_count == 2
    torch.testing.assert_close(logits_of(resumed.model), want, rtol=0, atol=0)
    train_step(trained)
    train_step(resumed)  # the same step only if the optimizer's moments and the schedule came back
    torch.testing.assert_close(logits_of(resumed.model), logits_of(trained.model), rtol=0, atol=0)
