"""What the PPO critic (algo.critic) costs per learner step: one learner rank in this process
(a one-rank gloo group, no Ray), the same mini-batch trained with grpo and with gae + critic,
the median step time of each and the critic's share.

    .venv/bin/python bench/critic.py                  # the default tiny Llama, 128 x 32 tokens, 10 steps
    .venv/bin/python bench/critic.py --hidden 256 --layers 4 --threads 2

The last line printed is JSON: per side the median step, pre-pass (critic values + GAE there),
policy forward/backward and the critic's step (time/learner_critic), and the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

# bench/ holds scripts named like stdlib modules (bench/queue.py); drop this script's own
# directory from the import path so `import queue` inside redis finds the stdlib one.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from asyncrl.config import load_config  # noqa: E402
from asyncrl.data import microbatch as mbatch  # noqa: E402
from asyncrl.data.batch import build_minibatches  # noqa: E402
from asyncrl.learner import fsdp, loss, optim  # noqa: E402
from asyncrl.learner.actor import LearnerActor  # noqa: E402
from asyncrl.learner.critic import Critic  # noqa: E402
from asyncrl.learner.group import FIELD_DTYPES  # noqa: E402
from asyncrl.rollout.tiny import write_tiny_model  # noqa: E402
from asyncrl.types import RolloutGroup, Sample  # noqa: E402
from bench.jsonout import JsonStdout  # noqa: E402


def groups(n_groups: int, n_samples: int, length: int) -> list[RolloutGroup]:
    """Multi-turn-shaped samples: 6 policy tokens, 2 observation tokens, repeated; reward 0/1."""
    rng = np.random.default_rng(0)
    mask = np.array(([1] * 6 + [0] * 2) * (length // 8 + 1))[:length]
    return [
        RolloutGroup(
            f"g{g}",
            f"p{g}",
            rng.integers(3, 30, 8),
            [
                Sample(
                    response_ids=rng.integers(3, 30, length),
                    rollout_logprobs=np.full(length, -1.0),
                    loss_mask=mask,
                    reward=float(s % 2),
                    behavior_version=0,
                )
                for s in range(n_samples)
            ],
        )
        for g in range(n_groups)
    ]


def side(base: str, mesh, data: list[RolloutGroup], critic: bool, steps: int) -> dict[str, float]:
    overrides = [f"rollout.model={base}", "learner.lr=1e-3", "control.total_steps=100"]
    if critic:
        overrides += ["algo.advantage_estimator=gae", "algo.critic.enabled=true", "algo.critic.lr=1e-3"]
    cfg = load_config(None, overrides)
    actor = LearnerActor(cfg, base, rank=0, world_size=1, sample_special_tokens=True)
    actor.device = torch.device("cpu")
    actor.model = fsdp.load_sharded_model(base, mesh, device=actor.device, dtype="float32")
    actor.critic = Critic.load(cfg, base, mesh, device=actor.device) if critic else None
    actor.optimizer = optim.build_optimizer(actor.model.parameters(), cfg.learner)
    actor.scheduler = optim.build_scheduler(actor.optimizer, cfg.learner, total_steps=100)
    actor.sampling = loss.Sampling.of(cfg.rollout)
    actor.logprob_fn = actor.sampling.logprob_fn()
    actor.disallowed, actor.pad_token_id, actor.reference = None, 0, None
    (mb,), _ = build_minibatches(data, cfg.algo, num_minibatches=1)
    plan = [[mbatch.seq_fields(s) for s in mb]]
    fields = FIELD_DTYPES | ({f: "float32" for f in mbatch.CRITIC_FIELDS} if critic else {})
    actor.train_minibatch(plan, 1, fields)  # warm-up
    rows = []
    for _ in range(steps):
        t0 = time.perf_counter()
        r = actor.train_minibatch(plan, 1, fields)
        critic_s = r.metrics["time/learner_critic"].value if critic else 0.0
        rows.append((time.perf_counter() - t0, r.seconds_prepass, r.seconds_forward_backward, critic_s))
    med = np.median(np.array(rows), axis=0)
    return {"step_s": med[0], "prepass_s": med[1], "policy_fwd_bwd_s": med[2], "critic_step_s": med[3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--length", type=int, default=24, help="response tokens per sample")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with JsonStdout() as out, tempfile.TemporaryDirectory(prefix="asyncrl-bench-critic-") as tmp:
        base = str(write_tiny_model(f"{tmp}/model", seed=0, hidden_size=args.hidden, num_layers=args.layers))
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            mesh = fsdp.build_mesh(torch.device("cpu"), 1)
            data = groups(args.groups, args.samples, args.length)
            result = {name: side(base, mesh, data, name == "gae", args.steps) for name in ("grpo", "gae")}
        finally:
            dist.destroy_process_group()
        result["ratio"] = result["gae"]["step_s"] / result["grpo"]["step_s"]
        for name in ("grpo", "gae"):
            out.line(f"{name}: " + ", ".join(f"{k} {v:.4f}" for k, v in result[name].items()))
        out.line(f"gae + critic / grpo step time: {result['ratio']:.2f}")
        out.result = result


if __name__ == "__main__":
    main()
