"""The tiny Idefics3 (SmolVLM's architecture) the vision-language tests and demo write: it loads in
transformers without torchvision, its processor expands ``<image>`` to the image's token count,
and its vision tower is wired in."""

from __future__ import annotations

import pytest

from asyncrl.data.images import ImageLimits

torch = pytest.importorskip("torch")


def _messages():
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]


def test_the_written_directory_loads_and_expands_each_image_to_its_tokens(tiny_idefics3):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor

    from asyncrl.rollout.tiny_vl import idefics3_image_seq_len

    processor = AutoProcessor.from_pretrained(str(tiny_idefics3))
    # the PIL image processor: the torchvision one cannot run on the CPU install
    assert type(AutoImageProcessor.from_pretrained(str(tiny_idefics3))).__name__ == "Idefics3ImageProcessorPil"
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_idefics3)).eval()
    assert type(model).__name__ == "Idefics3ForConditionalGeneration" and model.dtype == torch.float32
    seq_len = idefics3_image_seq_len(64, 16, 2)
    assert seq_len == 4 == processor.image_seq_len

    text = processor.apply_chat_template([_messages()[0], _messages()[0]])
    assert text == "<image>colour?<image>colour?"
    images = [Image.new("RGB", (56, 56), (220, 30, 30)), Image.new("RGB", (30, 90), (30, 30, 220))]
    enc = processor(text=[text], images=[images], return_tensors="pt")
    tokens = processor.tokenizer.convert_ids_to_tokens(enc["input_ids"][0].tolist())
    one = ["<fake_token_around_image>", "<global-img>", *["<image>"] * seq_len, "<fake_token_around_image>"]
    assert tokens == [*one, *"colour?", *one, *"colour?"]
    assert int((enc["input_ids"] == model.config.image_token_id).sum()) == 2 * seq_len
    # every image, whatever its shape, becomes one 64x64 global image (no tiling)
    assert tuple(enc["pixel_values"].shape) == (1, 2, 3, 64, 64)

    with torch.no_grad():
        logits = [
            model(
                input_ids=enc["input_ids"][:, :11],
                pixel_values=enc["pixel_values"][:, i : i + 1],
                pixel_attention_mask=enc["pixel_attention_mask"][:, i : i + 1],
            ).logits[0, -1]
            for i in range(2)
        ]
    assert not torch.allclose(logits[0], logits[1])  # the image reaches the decoder


def test_a_shape_that_does_not_divide_is_refused(tmp_path):
    from asyncrl.rollout.tiny_vl import write_tiny_idefics3

    with pytest.raises(ValueError, match="patch grid"):
        write_tiny_idefics3(tmp_path / "m", image_size=48, patch_size=16, scale_factor=2)
    assert not (tmp_path / "m").exists()


# --- the engine side's checks, before any engine: prompts with images through the chat template ---


@pytest.fixture(scope="module")
def encode(tiny_idefics3):
    from transformers import AutoTokenizer

    from asyncrl.data.images import ImageLimits
    from asyncrl.rollout.prompts import prompt_encoder
    from asyncrl.rollout.vision_prompts import VisionModel, with_images

    tok = AutoTokenizer.from_pretrained(str(tiny_idefics3))
    return with_images(prompt_encoder(tok, True), VisionModel.of(str(tiny_idefics3)), ImageLimits())


def test_a_colour_prompt_is_the_chat_templates_placeholder_and_its_image(tiny_idefics3, encode):
    import random

    from transformers import AutoProcessor

    from asyncrl.data.images import ImageLimits, check_group_images
    from asyncrl.rollout.envs.colour import ColourEnv
    from asyncrl.rollout.vision_prompts import VisionModel

    vision = VisionModel.of(str(tiny_idefics3))
    processor = AutoProcessor.from_pretrained(str(tiny_idefics3))
    assert vision == VisionModel("idefics3", processor.tokenizer.convert_tokens_to_ids("<image>"), 4)
    text, meta = ColourEnv().make_prompt(random.Random(0))
    ids = encode(text, meta)
    assert processor.tokenizer.convert_ids_to_tokens(ids) == ["<image>", *"colour?"]
    # the length the engine's expansion gives, as the processor expands it
    (image,) = check_group_images(meta, ImageLimits())
    expanded = processor(text=["<image>colour?"], images=[[image]])["input_ids"][0]
    assert vision.expanded_length(ids, 1) == len(expanded) == 14
    assert VisionModel.of("owner/name") is None  # a hub id: not read


def _png(size=(56, 56)) -> bytes:
    from PIL import Image

    from asyncrl.data.images import ImageLimits, encode_image

    return encode_image(Image.new("RGB", size, (220, 30, 30)), ImageLimits(max_pixels=1 << 24, max_bytes=1 << 24))


def _meta(images, parts: int = 1):
    from asyncrl.data.images import IMAGES_KEY
    from asyncrl.rollout.prompts import MESSAGES_KEY

    content = [{"type": "image"}] * parts + [{"type": "text", "text": "colour?"}]
    meta = {MESSAGES_KEY: [{"role": "user", "content": content}]}
    if images is not None:
        meta[IMAGES_KEY] = images
    return meta


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        (lambda: _meta([_png((600, 600))]), r"the prompt's images\[0\]: image 600x600 > rollout\.images\.max_pixels"),
        (lambda: _meta([_png()[:60]]), r"the prompt's images\[0\]: PNG does not decode"),
        (lambda: _meta([_png(), _png()]), r"1 image placeholder\(s\) for 2 image\(s\)"),
        (lambda: _meta(None), r"1 image placeholder\(s\) but no images"),
        (lambda: _meta([]), r"1 image placeholder\(s\) for 0 image\(s\)"),
        (lambda: _meta(["a red square"]), r"images\[0\] is str, expected PNG bytes"),
        (lambda: _meta([_png()] * 5, parts=5), r"5 images > rollout.images.max_images 4"),
        (lambda: _meta(_png()), r"expected a list"),
    ],
    ids=[
        "past-max-pixels",
        "corrupt-png",
        "more-images",
        "no-image",
        "empty-images",
        "not-an-image",
        "too-many",
        "bare",
    ],
)
def test_a_prompt_whose_images_the_engine_cannot_take_is_refused_before_it(encode, meta, why):
    from asyncrl.rollout.vision_prompts import PromptImageError

    with pytest.raises(PromptImageError, match=why):
        encode("colour?", meta())


def test_images_for_a_text_model_or_without_the_chat_template_are_refused(tiny_idefics3, tmp_path):
    from transformers import AutoTokenizer

    from asyncrl.data.images import ImageLimits
    from asyncrl.rollout.prompts import PromptSourceError, prompt_encoder
    from asyncrl.rollout.vision_prompts import PromptImageError, VisionModel, with_images

    tok = AutoTokenizer.from_pretrained(str(tiny_idefics3))
    text_model = with_images(prompt_encoder(tok, True), None, ImageLimits())
    with pytest.raises(PromptImageError, match=r"1 image\(s\), but rollout.model is not a vision-language model"):
        text_model("colour?", _meta([_png()]))
    no_template = with_images(prompt_encoder(tok, False), VisionModel.of(str(tiny_idefics3)), ImageLimits())
    with pytest.raises(PromptSourceError, match=r"rollout\.chat_template=true"):
        no_template("colour?", _meta([_png()]))
    assert text_model("abc", {}) == tok.encode("abc")  # a text prompt passes as before


def test_the_engine_prompt_ids_must_hold_each_images_tokens(tiny_idefics3):
    from asyncrl.rollout.vision_prompts import PromptImageError, VisionModel, engine_prompt_ids

    vision = VisionModel.of(str(tiny_idefics3))
    img, fake, glob = vision.image_token_id, vision.image_token_id - 1, vision.image_token_id + 1
    ran = [fake, glob, img, img, img, img, fake, 16]
    assert engine_prompt_ids([img, 16], ran, 1, vision) == ran
    assert engine_prompt_ids([5, 16], [5, 16], 0, vision) == [5, 16]  # no image: the ids given
    with pytest.raises(PromptImageError, match=r"4 image tokens for 2 image\(s\) \(expected 8\)"):
        engine_prompt_ids([img, img], ran, 2, vision)
    with pytest.raises(PromptImageError, match="no prompt ids"):
        engine_prompt_ids([img], None, 1, vision)


def test_idefics3_is_accepted_with_a_learner_that_takes_images_qwen2_vl_refused_for_torchvision(
    tiny_idefics3, monkeypatch
):
    from asyncrl.rollout import families

    assert families.check_model(str(tiny_idefics3)) is families.IDEFICS3
    for model_type in ("qwen2_vl", "qwen2_5_vl"):
        with pytest.raises(
            families.ModelRefused,
            match=r"learner builds Idefics3.s image inputs only.*torchvision.*Idefics3 \(SmolVLM\)",
        ):
            families.check_config("m", {"model_type": model_type, "vision_config": {}})
    with pytest.raises(families.ModelRefused, match="the generators do not hand prompt images to"):
        families.check_config("m", {"model_type": "llava", "vision_config": {}})
    # the guard: without a learner that feeds pixel values, an image run would train on text alone
    monkeypatch.setattr(families, "LEARNER_TAKES_IMAGES", False)
    with pytest.raises(families.ModelRefused, match=r"model_type idefics3\): the generators hand .* but the learner"):
        families.check_model(str(tiny_idefics3))


def test_check_says_what_the_engine_gets(tiny_idefics3):
    import random

    from asyncrl.config import ConfigError, RolloutConfig
    from asyncrl.rollout.envs.colour import ColourEnv
    from asyncrl.rollout.sampling import engine_args
    from asyncrl.rollout.vision_prompts import describe_images

    text, meta = ColourEnv().make_prompt(random.Random(0))
    (line,) = describe_images(str(tiny_idefics3), True, text, meta, "rollout.env=colour", ImageLimits())
    assert line == (
        "rollout.env=colour: a drawn prompt's 1 image(s) read and decoded (56x56); the engine gets them as "
        "multi_modal_data beside the prompt's 1 placeholder token(s) (id 60), each expanded to 4 image tokens "
        "(8 prompt tokens as given, 14 after)"
    )
    with pytest.raises(ConfigError, match=r"rollout\.env=colour: .*rollout\.chat_template=true"):
        describe_images(str(tiny_idefics3), False, text, meta, "rollout.env=colour", ImageLimits())
    (line,) = describe_images("owner/smolvlm", True, text, meta, "e", ImageLimits())
    assert line.endswith("what the engine gets not checked ('owner/smolvlm' is not a local model directory)")
    # the engine is built for at most max_images a prompt (vLLM's default, 999, is profiled at start-up)
    args = engine_args(RolloutConfig(), str(tiny_idefics3), 0, platform="cpu")
    assert args.limit_mm_per_prompt == {"image": 4}
    # ... the run's rollout.images.max_images, which every prompt is checked against first
    args = engine_args(RolloutConfig(images={"max_images": 7}), str(tiny_idefics3), 0, platform="cpu")
    assert args.limit_mm_per_prompt == {"image": 7}


class ExpandingEngine:
    """What GroupMaker reads of its engine, answering as vLLM does for Idefics3 (each ``<image>``
    expanded to the image's tokens in the prompt ids it reports): the plumbing between the
    encoder, GroupMaker and the record. The real engine: tests/integration/test_vision_engine.py."""

    version = 0

    def __init__(self, vision, tok):
        self.vision, self.tok = vision, tok
        self.requests: list[tuple[list[int], list]] = []

    async def generate(self, prompt_ids, n, request_id, images=None, **kw):
        from asyncrl.rollout.completions import Completion

        self.requests.append((list(prompt_ids), list(images or [])))
        one = self.tok.convert_tokens_to_ids(["<fake_token_around_image>", "<global-img>"])
        image = [one[0], one[1], *[self.vision.image_token_id] * 4, one[0]]
        ran = [t for i in prompt_ids for t in (image if i == self.vision.image_token_id else [i])]
        return [Completion([40, 41], [-1.0, -1.0], [0, 0], "length", prompt_ids=ran) for _ in range(n)]


def test_a_group_carries_the_engines_expanded_ids_and_hands_it_the_decoded_images(tiny_idefics3, encode):
    import asyncio
    import random

    from transformers import AutoTokenizer

    from asyncrl.config import Config
    from asyncrl.data.images import IMAGES_KEY
    from asyncrl.rollout.envs.colour import ColourEnv
    from asyncrl.rollout.groups import GroupMaker
    from asyncrl.rollout.prompts import PromptItem
    from asyncrl.rollout.vision_prompts import PromptImageError, VisionModel

    tok = AutoTokenizer.from_pretrained(str(tiny_idefics3))
    vision = VisionModel.of(str(tiny_idefics3))
    engine = ExpandingEngine(vision, tok)
    cfg = Config()
    cfg.rollout.n_samples = 2
    env = ColourEnv()
    maker = GroupMaker(cfg, env, tok, engine, "g", vision)  # type: ignore[arg-type]
    text, meta = env.make_prompt(random.Random(0))
    ids = encode(text, meta)
    group = asyncio.run(maker.make(PromptItem("p:0", text, meta, ids)))
    ((given, images),) = engine.requests
    assert given == ids and [i.size for i in images] == [(56, 56)]  # one placeholder, the decoded image
    assert len(group.prompt_ids) == 14 == maker.prompt_length(ids, meta)
    assert int((group.prompt_ids == vision.image_token_id).sum()) == 4
    assert group.metadata[IMAGES_KEY] == meta[IMAGES_KEY]
    # a text model's maker refuses the images; a placeholder without one never reaches the engine
    with pytest.raises(PromptImageError, match="not a vision-language model"):
        asyncio.run(GroupMaker(cfg, env, tok, engine, "g").make(PromptItem("p:1", text, meta, ids)))  # type: ignore[arg-type]
    bare = {k: v for k, v in meta.items() if k != IMAGES_KEY}
    with pytest.raises(PromptImageError, match="but no images"):
        asyncio.run(maker.make(PromptItem("p:2", text, bare, ids)))
    assert len(engine.requests) == 1


def test_check_names_the_vision_family_without_claiming_the_text_parity_matrix(tiny_idefics3):
    from asyncrl.rollout import families

    line = families.describe(str(tiny_idefics3))
    assert line.startswith("model family: Idefics3 / SmolVLM, vision-language") and "parity" not in line


class OneAnswerLLM:
    """vLLM's AsyncLLM as RolloutEngine.generate reads it: one final output per request, whose
    finish reason is given; the prompts it was handed are kept."""

    errored = False

    def __init__(self, finish_reason: str):
        self.finish_reason = finish_reason
        self.prompts: list[dict] = []

    async def generate(self, prompt, params, request_id, lora_request=None):
        from types import SimpleNamespace

        self.prompts.append(prompt)
        tokens = [] if self.finish_reason == "error" else [5]
        out = SimpleNamespace(
            index=0, token_ids=tokens, logprobs=None, weight_versions=None, finish_reason=self.finish_reason
        )
        yield SimpleNamespace(outputs=[out], prompt_token_ids=[7, 7, 7], num_cached_tokens=0)


def test_the_engine_hands_vllm_the_images_and_retries_its_retryable_error():
    """vLLM ends a request whose image its engine core lost (front-end/engine-core cache drift,
    after another request with that image failed) with no tokens and finish_reason 'error', its
    retryable error: that is RequestAborted (the generator runs the prompt again), not a sample."""
    import asyncio

    from PIL import Image

    from asyncrl.config import Config
    from asyncrl.rollout.engine import RequestAborted, RolloutEngine

    image = Image.new("RGB", (8, 8))
    engine = RolloutEngine(OneAnswerLLM("length"), Config().rollout, "unused", [], seed=0)
    (done,) = asyncio.run(engine.generate([60, 16], 1, "r:0", images=[image]))
    assert engine.llm.prompts[0]["multi_modal_data"] == {"image": [image]}
    assert engine.llm.prompts[0]["prompt_token_ids"] == [60, 16] and done.prompt_ids == [7, 7, 7]
    asyncio.run(engine.generate([16], 1, "r:1"))
    assert "multi_modal_data" not in engine.llm.prompts[1]  # a text prompt as before
    engine.llm = OneAnswerLLM("error")
    with pytest.raises(RequestAborted, match="retryable engine error"):
        asyncio.run(engine.generate([60, 16], 1, "r:2", images=[image]))


class RefusingLLM(OneAnswerLLM):
    """An AsyncLLM whose request validation refuses every input, as vLLM's input processor
    refuses a prompt longer than max_model_len once its images are expanded."""

    async def generate(self, prompt, params, request_id, lora_request=None):
        from vllm.exceptions import VLLMValidationError

        self.prompts.append(prompt)
        raise VLLMValidationError("The decoder prompt (length 1100) is longer than the maximum model length of 1024.")
        yield  # an async generator, as vLLM's


def test_an_input_the_engine_refuses_is_skipped_not_run_again():
    """A prompt vLLM's validation refuses (an image processor that splits images makes the
    expanded length unknowable beforehand) would be refused on every retry: PromptRefused, which
    the generator skips with the reason, not the generic failure it re-issues forever."""
    import asyncio

    pytest.importorskip("vllm")
    from asyncrl.config import Config
    from asyncrl.rollout.engine import PromptRefused, RequestAborted, RolloutEngine

    engine = RolloutEngine(RefusingLLM("length"), Config().rollout, "unused", [], seed=0)
    with pytest.raises(PromptRefused, match="longer than the maximum model length") as caught:
        asyncio.run(engine.generate([60, 16], 1, "r:0"))
    assert not isinstance(caught.value, RequestAborted)
    engine.llm = OneAnswerLLM("length")  # any other outcome as before
    (done,) = asyncio.run(engine.generate([16], 1, "r:1"))
    assert done.token_ids == [5]


def test_a_group_made_here_is_what_the_learner_takes(tiny_idefics3, encode):
    """The interface between the halves: a group GroupMaker made (expanded ids as vLLM reports
    them, the PNG bytes once) becomes learner sequences with one image tile each, none refused."""
    import asyncio
    import random

    from transformers import AutoTokenizer

    from asyncrl.config import AlgoConfig, Config
    from asyncrl.data.batch import build_minibatches
    from asyncrl.data.pixels import ImagePixels
    from asyncrl.rollout.envs.colour import ColourEnv
    from asyncrl.rollout.groups import GroupMaker
    from asyncrl.rollout.prompts import PromptItem
    from asyncrl.rollout.vision_prompts import VisionModel

    tok = AutoTokenizer.from_pretrained(str(tiny_idefics3))
    vision = VisionModel.of(str(tiny_idefics3))
    cfg = Config()
    cfg.rollout.n_samples = 2
    env = ColourEnv()
    maker = GroupMaker(cfg, env, tok, ExpandingEngine(vision, tok), "g", vision)  # type: ignore[arg-type]
    groups = []
    for k in range(2):
        text, meta = env.make_prompt(random.Random(k))
        groups.append(asyncio.run(maker.make(PromptItem(f"p:{k}", text, meta, encode(text, meta)))))
    for g, s in zip(groups, (0.0, 1.0), strict=True):  # rewards with a spread: advantages not all 0
        g.samples[0].reward, g.samples[1].reward = s, 1.0 - s
    pixels = ImagePixels.of(str(tiny_idefics3))
    (seqs,), metrics = build_minibatches(groups, AlgoConfig(), num_minibatches=1, pixels=pixels)
    assert len(seqs) == 4 and metrics.get("vision/refused_samples", 0) == 0
    assert all(s.pixel_values is not None and s.pixel_values.shape == (1, 3, 64, 64) for s in seqs)


def test_a_run_that_would_sample_or_score_without_the_images_refuses_them_as_drawn(tiny_idefics3):
    """Multi-turn environments and a teacher take no images yet: refused at the first prompt with
    images (a generator stops with the reason), not one failed group at a time."""
    from transformers import AutoTokenizer

    from asyncrl.data.images import ImageLimits
    from asyncrl.rollout.prompts import prompt_encoder
    from asyncrl.rollout.vision_prompts import PromptImageError, VisionModel, images_refused, with_images

    tok = AutoTokenizer.from_pretrained(str(tiny_idefics3))
    vision = VisionModel.of(str(tiny_idefics3))
    assert images_refused("colour", False, False) is None
    for refused, why in [
        (images_refused("countdown_chat", True, False), r"rollout.env='countdown_chat' is multi-turn"),
        (images_refused("colour", False, True), r"rollout.teacher scores prompts without their images"),
    ]:
        encode = with_images(prompt_encoder(tok, True), vision, ImageLimits(), refused)
        with pytest.raises(PromptImageError, match=rf"the prompt carries images, but {why}"):
            encode("colour?", _meta([_png()]))
        assert encode("abc", {}) == tok.encode("abc")  # a text prompt of the same run passes
