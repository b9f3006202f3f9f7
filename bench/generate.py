"""Generation throughput: a GeneratorActor putting rollout groups into a real Redis queue,
against the bare vLLM AsyncLLM engine doing the same requests, in the same run.

    .venv/bin/python bench/generate.py --quick          # ~60 s of timed work (+ engine start)
    .venv/bin/python bench/generate.py --rounds 6 --groups 48
    .venv/bin/python bench/generate.py --smoke          # one round of 4 small groups (the test suite's)

One engine serves both sides (so the two never differ by engine instance or start-up): the
in-process GeneratorActor runs its real loop (prompt stream, admission, in-flight notes in
Redis, sampling, reward, msgpack, put into the stream) for one round of ``--groups`` groups,
(read back from the queue once the round's clock stopped); then the same requests (same prompt ids,
so the same seeds and tokens, same sampling settings, same number in flight) go straight to
the bare ``AsyncLLM.generate``. Rounds alternate so load spikes on a shared box hit both.
Tokens/s counts response tokens; the last line is JSON with ``ratio`` (generator / bare,
from the summed times of all rounds; goal >= 0.9).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

# bench/ holds scripts named like stdlib modules (bench/queue.py); keep it off the import path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.jsonout import JsonStdout  # noqa: E402

RUN = "bench-generate"


def generator_round(gen, queue, consumer, groups: int, admitted: int) -> tuple[float, list]:
    """Admit ``groups`` more (``admitted`` so far); seconds until the last is in the queue.

    The trainer's side (reading the groups back) runs after the clock stops: in a real job
    it is another process, here it would compete with the generator for this one's GIL."""
    target = gen.production.counts.groups + groups
    t0 = time.perf_counter()
    from asyncrl.queue import RunState

    RunState.of(queue).configure_admission(max_staleness=0, groups_per_step=admitted + groups)
    deadline = t0 + 600
    while gen.production.counts.groups < target and time.perf_counter() < deadline:
        time.sleep(0.002)  # counts.groups goes up right after the put returned
    seconds = time.perf_counter() - t0
    got = []
    while len(got) < groups and time.perf_counter() < deadline:
        items = consumer.get_batch(groups - len(got), min_version=0, timeout=1.0)
        consumer.ack([i for i, _ in items])
        got += [g for _, g in items]
    if len(got) < groups:
        raise RuntimeError(f"only {len(got)}/{groups} groups arrived; {gen.stats()}")
    return seconds, got


class ConcurrencySampler:
    """Mean number of unfinished requests in the engine while running (every 5 ms)."""

    def __init__(self, llm, gen=None):
        import threading

        self.llm, self.gen, self.samples, self.slots, self.stop = llm, gen, [], [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(0.005):
            self.samples.append(self.llm.output_processor.get_num_unfinished_requests())
            if self.gen is not None:
                self.slots.append(self.gen.production.slots_taken)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    @property
    def mean(self) -> float:
        return sum(self.samples) / max(len(self.samples), 1)


def cpu_seconds(procs: dict) -> dict:
    """User+system CPU seconds so far of each named group of processes (where the time goes)."""
    out = {}
    for name, group in procs.items():
        total = 0.0
        for p in group:
            t = p.cpu_times()
            total += t.user + t.system
        out[name] = total
    return out


def cpu_delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


async def bare_round(engine, requests: list, concurrency: int) -> tuple[float, int]:
    """The same requests on the bare AsyncLLM, ``concurrency`` at a time; (seconds, tokens)."""
    import asyncio

    from vllm.inputs import TokensPrompt

    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(request_id: str, prompt_ids: list[int], max_tokens: int | None):
        nonlocal tokens
        async with sem:
            params = engine.sampling_params(len_n, request_id, max_tokens)
            final = None
            async for out in engine.llm.generate(
                TokensPrompt(prompt_token_ids=prompt_ids), params, f"{request_id}-bare"
            ):
                final = out
            tokens += sum(len(c.token_ids) for c in final.outputs)

    len_n = engine.rollout.n_samples
    t0 = time.perf_counter()
    await asyncio.gather(*(one(*r) for r in requests))
    return time.perf_counter() - t0, tokens


def main(argv: list[str] | None = None) -> dict:
    with JsonStdout() as out:
        out.result = run(argv)
    return out.result


def run(argv: list[str] | None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 rounds of 64 groups: ~60 s of timed work")
    parser.add_argument(
        "--smoke", action="store_true", help="1 round of 4 groups of 2 x 8 tokens: engine start + seconds"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", type=int, default=32, help="groups per round")
    parser.add_argument("--n", type=int, default=8, help="samples per group")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--inflight", type=int, default=8, help="groups in flight at once (both sides)")
    parser.add_argument("--env", default="copy")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.groups = 4, 64
    if args.smoke:
        args.rounds, args.groups, args.n, args.max_tokens, args.inflight = 1, 4, 2, 8, 2

    import logging

    from rich.progress import Progress

    from asyncrl.config import Config, RolloutConfig
    from asyncrl.queue import RolloutQueue, RunState
    from asyncrl.queue.server import EmbeddedRedis
    from asyncrl.rollout.generator import GeneratorActor
    from asyncrl.rollout.tiny import write_tiny_model

    logging.getLogger("vllm").setLevel(logging.WARNING)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = Config()
    cfg.rollout = RolloutConfig(
        n_samples=args.n,
        max_tokens=args.max_tokens,
        temperature=1.0,
        env=args.env,
        max_inflight_groups=args.inflight,
        engine_max_num_seqs=max(64, args.n * args.inflight),
        engine_max_model_len=256,
        seed=0,
    )
    cfg.queue.maxlen = 100_000
    gen_s, bare_s, gen_tokens, bare_tokens = 0.0, 0.0, 0, 0
    with tempfile.TemporaryDirectory() as tmp, Progress(transient=True) as progress:
        model_dir = str(write_tiny_model(os.path.join(tmp, "model")))
        server = EmbeddedRedis(os.path.join(tmp, "redis"), aof=False)
        server.start()
        gen = queue = consumer = None
        try:
            task = progress.add_task("starting the engine", total=args.rounds)
            t_start = time.perf_counter()
            gen = GeneratorActor(cfg, model_dir, "bench", server.url, RUN)
            startup_s = time.perf_counter() - t_start
            queue = RolloutQueue.connect(server.url, RUN, consumer="bench-admin")
            queue_rs = RunState.of(queue)
            consumer = RolloutQueue.connect(server.url, RUN, consumer="bench-learner")
            queue_rs.set_policy_version(0)
            gen.start()  # admits nothing until a round configures admission
            # warm-up round (not timed): first-request compilation/allocation on both paths
            _, warm = generator_round(gen, queue, consumer, args.inflight, 0)
            gen._call(bare_round(gen.engine, [(g.prompt_id, g.prompt_ids.tolist(), None) for g in warm], args.inflight))
            admitted = args.inflight
            import psutil

            procs = {
                "this_process": [psutil.Process()],
                "engine_processes": [psutil.Process(p) for p, _ in gen.engine.engine_pids],
                "redis_server": [psutil.Process(server.pid)],
            }
            cpu = {"generator": dict.fromkeys(procs, 0.0), "bare": dict.fromkeys(procs, 0.0)}
            concurrency: dict = {"generator": [], "bare": []}
            slots: list = []
            for r in range(args.rounds):
                progress.update(task, description=f"round {r + 1}/{args.rounds}: generator vs bare AsyncLLM")
                c0 = cpu_seconds(procs)
                with ConcurrencySampler(gen.engine.llm, gen) as conc:
                    seconds, groups = generator_round(gen, queue, consumer, args.groups, admitted)
                concurrency["generator"].append(conc.mean)
                slots.append(sum(conc.slots) / max(len(conc.slots), 1))
                c1 = cpu_seconds(procs)  # (includes reading the groups back, after the clock stopped)
                admitted += args.groups
                gen_s += seconds
                gen_tokens += sum(s.num_tokens for g in groups for s in g.samples)
                requests = [(g.prompt_id, g.prompt_ids.tolist(), g.metadata.get("max_tokens")) for g in groups]
                c2 = cpu_seconds(procs)
                with ConcurrencySampler(gen.engine.llm) as conc:
                    seconds, tokens = gen._call(bare_round(gen.engine, requests, args.inflight))
                concurrency["bare"].append(conc.mean)
                c3 = cpu_seconds(procs)
                for side, (a, b) in (("generator", (c0, c1)), ("bare", (c2, c3))):
                    for k, v in cpu_delta(b, a).items():
                        cpu[side][k] += v
                bare_s += seconds
                bare_tokens += tokens
                progress.advance(task)
            stats = gen.stats()
        finally:
            if gen is not None:
                gen.shutdown()
            for q in (queue, consumer):
                if q is not None:
                    q.close()
            server.stop()
    result = {
        "ratio": round((gen_tokens / gen_s) / (bare_tokens / bare_s), 3),
        "generator_tokens_per_s": round(gen_tokens / gen_s, 1),
        "bare_tokens_per_s": round(bare_tokens / bare_s, 1),
        "generator_tokens": gen_tokens,
        "bare_tokens": bare_tokens,
        "timed_s": round(gen_s + bare_s, 1),
        "engine_startup_s": round(startup_s, 1),
        "rounds": args.rounds,
        "groups_per_round": args.groups,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "inflight_groups": args.inflight,
        "reward_errors": stats["reward_errors"],
        "goal": ">= 0.9",
        "admission_ms_per_call": round(1e3 * stats["admission_s"] / max(stats["admission_calls"], 1), 2),
        "generator_groups_generating": round(sum(slots) / len(slots), 2),
        "requests_in_engine": {k: round(sum(v) / len(v), 2) for k, v in concurrency.items()},
        "cpu_s": {side: {k: round(v, 1) for k, v in d.items()} for side, d in cpu.items()},
        # Every round's groups arrived (generator_round raises otherwise), none with a reward
        # error, and both sides generated. (Identical token counts are the norm, not checked:
        # vLLM-CPU's numerics may differ with the batch's composition.)
        "checks": {
            "no_reward_errors": stats["reward_errors"] == 0,
            "both_sides_generated": gen_tokens > 0 and bare_tokens > 0,
        },
    }
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
