"""LoRA on the learner (learner.lora): the tiny model loaded and sharded by the learner's own
fsdp.load_sharded_model (FSDP2 on a one-rank gloo group) with PEFT adapters in it.

Only the adapters train, sit in the optimizer and in the DCP checkpoint; the KL reference is
the same model with the adapters off and equals the base model; what a publish sends (the
adapter in PEFT format, or the merged weights) gives plain transformers + PEFT the learner's
own logits; `asyncrl export` of a LoRA checkpoint round-trips (merged, and --adapter).

    .venv/bin/python -m pytest tests/unit/test_lora.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from asyncrl.config import ConfigError, LoraConfig, load_config
from asyncrl.learner import checkpoint, fsdp, lora, optim
from asyncrl.rollout.tiny import write_tiny_model
from asyncrl.rundir import CHECKPOINTS_DIR, CONFIG_FILE

LORA = LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
IDS = torch.tensor([[1, 5, 9, 14, 20, 7, 33, 12]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def load(tiny, mesh, cfg=LORA):
    peft_model = fsdp.load_sharded_model(tiny, mesh, device=torch.device("cpu"), dtype="float32", lora=cfg)
    return peft_model, peft_model.base_model.model


def train_steps(model, opt, steps=3):
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=IDS, use_cache=False).logits
        torch.log_softmax(logits, -1)[0, :-1].gather(-1, IDS[0, 1:, None]).sum().backward()
        opt.step()


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits.float()


def base_model(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).train(False)


def peft_with(tiny, adapter_state: dict[str, torch.Tensor]):
    """Plain transformers + PEFT (no FSDP) holding a published adapter."""
    from peft import get_peft_model, set_peft_model_state_dict

    m = get_peft_model(base_model(tiny), lora.peft_config(LORA, tiny)).train(False)
    result = set_peft_model_state_dict(m, adapter_state)
    assert not result.unexpected_keys
    return m


def test_only_adapters_train_checkpoint_and_reference_is_the_base(tiny, mesh, tmp_path):
    _, model = load(tiny, mesh)
    opt = optim.build_optimizer(model.parameters(), load_config().learner)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in in_opt}
    # 2 layers x 3 targets x (A, B); nothing of the base.
    assert len(names) == 12 and all(lora.is_adapter(n) for n in names), sorted(names)
    base_before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters() if not lora.is_adapter(n)}

    reference = lora.AdapterDisabled(model)
    train_steps(model, opt)
    # The reference forward in between must leave every adapter trainable (the last block
    # stays gathered after its forward: see lora.AdapterDisabled).
    ref = logits_of(reference)
    train_steps(model, opt, steps=1)
    for n, p in model.named_parameters():
        if not lora.is_adapter(n):
            assert torch.equal(p.detach().full_tensor(), base_before[n]), n
    assert all(p.requires_grad and p.grad is not None for n, p in model.named_parameters() if lora.is_adapter(n))
    torch.testing.assert_close(logits_of(reference), logits_of(base_model(tiny)), rtol=0, atol=1e-5)
    torch.testing.assert_close(ref, logits_of(reference), rtol=0, atol=1e-6)
    adapted = logits_of(model)
    assert (adapted - ref).abs().max() > 1e-3  # the adapters moved the policy

    # DCP holds the adapters (and their AdamW state) only, and restores them.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    sched = optim.build_scheduler(opt, load_config().learner, total_steps=10)
    checkpoint.save_rank_state(ckpt, model, opt, sched, rank=0, step=4, version=4)
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata)
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert model_keys == names, "\n".join(sorted(keys))
    assert not any(".base_layer." in k or "embed_tokens" in k for k in keys)

    _, fresh = load(tiny, mesh)
    fresh_opt = optim.build_optimizer(fresh.parameters(), load_config().learner)
    fresh_sched = optim.build_scheduler(fresh_opt, load_config().learner, total_steps=10)
    assert checkpoint.load_rank_state(ckpt, fresh, fresh_opt, fresh_sched, rank=0) == (4, 4)
    torch.testing.assert_close(logits_of(fresh), adapted, rtol=0, atol=0)

    # What a publish sends: the adapter alone (PEFT names), or merged full weights; plain
    # transformers + PEFT, and a plain model, compute the learner's logits from either.
    adapter = lora.adapter_state(model)
    assert set(adapter) == {lora.peft_name(n) for n in names}
    torch.testing.assert_close(logits_of(peft_with(tiny, adapter)), adapted, rtol=0, atol=1e-5)
    merged = lora.merged_weights(fsdp.full_state_dict(model), lora.scale(LORA))
    plain = base_model(tiny)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    torch.testing.assert_close(logits_of(plain), adapted, rtol=0, atol=1e-5)
    full = sum(t.numel() * t.element_size() for t in merged.values())
    small = sum(t.numel() * t.element_size() for t in adapter.values())
    assert full >= 10 * small, (full, small)

    # `asyncrl export` of that checkpoint: merged (plain transformers) and --adapter (PEFT).
    from peft import PeftModel

    from asyncrl.control.export import export_checkpoint

    run = tmp_path / "run"
    cfg = load_config(None, ["rollout.model=" + tiny, "learner.lora.r=4", "learner.lora.alpha=8"])
    cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"lora": LORA})})
    (run / CHECKPOINTS_DIR).mkdir(parents=True)
    (run / CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    staging = checkpoint.staging_dir(run / CHECKPOINTS_DIR / "step_000004")
    checkpoint.save_rank_state(staging, model, opt, sched, rank=0, step=4, version=4)
    checkpoint.publish(staging, run / CHECKPOINTS_DIR / "step_000004", {})
    merged_dir = export_checkpoint(run)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).train(False)
    torch.testing.assert_close(logits_of(exported), adapted, rtol=0, atol=1e-5)
    adapter_dir = export_checkpoint(run, adapter=True)
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 4
    with_adapter = PeftModel.from_pretrained(base_model(tiny), str(adapter_dir)).train(False)
    torch.testing.assert_close(logits_of(with_adapter), adapted, rtol=0, atol=1e-5)


def test_dropout_only_in_the_block(tiny, mesh):
    _, model = load(tiny, mesh, LORA.model_copy(update={"dropout": 0.1}))
    drops = [m for n, m in model.named_modules() if ".lora_dropout." in n]
    assert drops and not any(m.training for m in drops)
    with lora.dropout_active(model, True):
        assert all(m.training for m in drops)
    assert not any(m.training for m in drops)


def test_publish_path():
    from asyncrl.config import SyncConfig
    from asyncrl.sync.weight_sync import lora_publish

    assert lora_publish(None, SyncConfig(backend="shm")) is None
    assert lora_publish(LoraConfig(), SyncConfig(backend="shm")) == "adapter"
    assert lora_publish(LoraConfig(), SyncConfig(backend="object_store")) == "adapter"
    assert lora_publish(LoraConfig(), SyncConfig(backend="nccl")) == "merged"
    assert lora_publish(LoraConfig(publish="merged"), SyncConfig(backend="shm")) == "merged"
    with pytest.raises(ConfigError, match=r"learner\.lora\.publish=adapter: the nccl sync"):
        lora_publish(LoraConfig(publish="adapter"), SyncConfig(backend="nccl"))


def test_engine_lora_rank_fits_vllms_buffers():
    from asyncrl.rollout.adapters import lora_engine_args

    assert lora_engine_args(LoraConfig(r=8))["max_lora_rank"] == 8
    assert lora_engine_args(LoraConfig(r=12)) == {
        "enable_lora": True,
        "max_lora_rank": 16,
        "max_loras": 1,
        "max_cpu_loras": 1,
    }
    with pytest.raises(ValueError, match=r"learner\.lora\.r=600: vLLM takes adapters up to rank 512"):
        lora_engine_args(LoraConfig(r=600))


def test_the_engines_version_0_adapter_is_zeros_in_the_runs_format(tiny):
    """An engine of an adapter-publishing run holds this from the start (rollout/adapters.py):
    PEFT's names for every target module (so vLLM takes it), every tensor zero (the base model)."""
    from peft import PeftModel

    from asyncrl.rollout.adapters import BASE_DIR, AdapterSlot

    zero = lora.zero_adapter(LORA, tiny)
    real = peft_with(tiny, zero)
    assert set(zero) == {lora.peft_name(n) for n, _ in real.base_model.model.named_parameters() if lora.is_adapter(n)}
    assert all(not t.any() for t in zero.values())
    slot = AdapterSlot(LORA, tiny)
    try:
        as_loaded = PeftModel.from_pretrained(base_model(tiny), f"{slot.dir}/{BASE_DIR}").train(False)
        assert as_loaded.peft_config["default"].r == 1  # any engine's max_lora_rank takes it
        torch.testing.assert_close(logits_of(as_loaded), logits_of(base_model(tiny)), rtol=0, atol=0)
    finally:
        slot.close()


def test_target_modules_the_family_lacks_fail_before_an_engine_starts_and_leave_no_folder(tiny, monkeypatch, tmp_path):
    """The version-0 adapter is built from the model's own layers, so a target module the family
    does not have is refused there: by PEFT's own message, before the engine (minutes on a GPU,
    processes to stop) is started, and without leaving the slot's temp folder behind."""
    import asyncio
    import glob
    import tempfile

    from vllm.v1.engine.async_llm import AsyncLLM

    from asyncrl.rollout.adapters import AdapterSlot
    from asyncrl.rollout.engine import RolloutEngine

    bad = LoraConfig(r=4, target_modules=["no_such_proj"])
    # A temp dir of its own: LoRA jobs running meanwhile (the suite's other lane) make and
    # remove asyncrl-lora-* folders in the shared one.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folders = set(glob.glob(f"{tempfile.gettempdir()}/asyncrl-lora-*"))
    with pytest.raises(ValueError, match="no_such_proj"):
        AdapterSlot(bad, tiny)
    assert set(glob.glob(f"{tempfile.gettempdir()}/asyncrl-lora-*")) == folders

    def no_engine(*_, **__):
        raise AssertionError("an engine was started for a LoRA config that cannot load")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", no_engine)
    rollout = load_config("configs/demo.yaml").rollout
    with pytest.raises(ValueError, match="no_such_proj"):
        asyncio.run(RolloutEngine.start(rollout, tiny, seed=0, lora=bad))
    assert set(glob.glob(f"{tempfile.gettempdir()}/asyncrl-lora-*")) == folders
