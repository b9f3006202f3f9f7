"""Does the tiny Qwen2-VL learn the colour task? REINFORCE on transformers alone (no engine: the
CPU vLLM cannot load a vision-language model, docs/guide/vision.md).

    .venv/bin/python bench/vision_colour.py                   # red/blue, 200 steps (~6 min on 2 cores)
    .venv/bin/python bench/vision_colour.py --colours red,green,blue,yellow --steps 400

Each step: 8 prompts (asyncrl.rollout.envs.colour, one image each) x 4 samples drawn with the
model's ``generate`` (temperature 1, special tokens but EOS banned, as the generators ban them
for this task), advantage = reward - the group's mean, loss = -advantage x the response's
log-prob from the learner's one-pass forward with the pixel values
(asyncrl.learner.vision.response_logprobs), Adam. Reported: the mean reward of the first and
last 10 steps, and per colour on 8 held-out images, before and after: the greedy answers, their
exact-match rate and mean reward. Different answers for different colours are the check that
the image is used: the text of every prompt is the same.

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]


def main(argv: list[str] | None = None) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText

    from asyncrl.data.images import ImageLimits, check_group_images
    from asyncrl.data.vision import VisionPrompter
    from asyncrl.learner.vision import mm_token_type_ids, response_logprobs
    from asyncrl.rollout.envs.colour import ColourEnv
    from asyncrl.rollout.tiny_vl import write_tiny_vl_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--colours", default="red,blue")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    path = write_tiny_vl_model(tempfile.mkdtemp(prefix="asyncrl-vl-") + "/model")
    vl = VisionPrompter.load(str(path))
    tok = vl.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(str(path)).float()
    env = ColourEnv(colours=args.colours)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    banned = [[i] for i in tok.all_special_ids if i != tok.eos_token_id]

    def sample(vp, n: int, greedy: bool) -> list[list[int]]:
        ids = torch.as_tensor(vp.input_ids[None].astype(np.int64))
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.repeat(n, 1),
                mm_token_type_ids=mm_token_type_ids(model, ids).repeat(n, 1),
                pixel_values=torch.as_tensor(vp.pixel_values).repeat(n, 1),
                image_grid_thw=torch.as_tensor(vp.image_grid_thw).repeat(n, 1),
                attention_mask=torch.ones(n, ids.shape[1], dtype=torch.long),
                do_sample=not greedy,
                temperature=1.0,
                top_k=0,
                bad_words_ids=banned,
                max_new_tokens=7,
                pad_token_id=tok.pad_token_id,
            )
        rows = []
        for row in out[:, ids.shape[1] :].tolist():
            row = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
            rows.append([t for t in row if t != tok.pad_token_id])
        return rows

    def greedy() -> dict[str, dict]:
        """Per colour, on 8 held-out images: exact-match rate, mean reward, the answers given."""
        model.eval()
        scores = {}
        for name in env.names:
            answers = []
            for k in range(8):
                vp = vl.encode(MESSAGES, [env.draw(name, random.Random(1000 + k))])
                answers.append(tok.decode(sample(vp, 1, greedy=True)[0], skip_special_tokens=True))
            scores[name] = {
                "exact": sum(a == name for a in answers) / 8,
                "reward": float(np.mean([env.reward("", a, {"target": name}) for a in answers])),
                "answers": sorted(set(answers)),
            }
        return scores

    before = greedy()
    rng = random.Random(0)
    rewards_per_step = []
    for step in range(args.steps):
        opt.zero_grad()
        step_rewards: list[float] = []
        for _ in range(8):
            _, meta = env.make_prompt(rng)
            vp = vl.encode(MESSAGES, check_group_images(meta, ImageLimits()))
            model.eval()
            responses = sample(vp, 4, greedy=False)
            model.train()
            rewards = [env.reward("", tok.decode(r, skip_special_tokens=True), meta) for r in responses]
            for r, adv in zip(responses, np.array(rewards) - np.mean(rewards), strict=True):
                if adv != 0 and r:
                    (-(adv * response_logprobs(model, vp, np.array(r)).sum()) / 32).backward()
            step_rewards += rewards
        opt.step()
        rewards_per_step.append(float(np.mean(step_rewards)))
        print(f"step {step} mean reward {rewards_per_step[-1]:.3f}", flush=True)
    result = {
        "colours": env.names,
        "steps": args.steps,
        "reward_first10": float(np.mean(rewards_per_step[:10])),
        "reward_last10": float(np.mean(rewards_per_step[-10:])),
        "greedy_before": before,
        "greedy_after": greedy(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
