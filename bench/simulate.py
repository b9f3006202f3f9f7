"""Discrete-event simulator of the async pipeline: predict throughput and staleness.

    python bench/simulate.py --quick                      # demo-like and 7B-like scenarios
    python bench/simulate.py --smoke                      # the same scenarios, few steps (the test suite's)
    python bench/simulate.py --from-peers bench/results/peers.json   # bench/peers.py's measured costs
    python bench/simulate.py --generators 64 --slots 32 --gen-mean 40 --gen-cv 0.8 \\
        --train-step 30 --sync 4 --groups-per-step 512 --max-staleness 2

Model (the same rules as asyncrl.control):
  * G generators, each running up to `slots` groups at once (continuous batching) and
    sharing its compute among them: up to `parallel` groups run at full speed, beyond that
    each slows by parallel/k (processor sharing), so more concurrency is not free. A
    group's generation time alone is drawn from a length distribution (lognormal with
    mean and coefficient of variation, or samples measured on a real run).
  * Admission: a group may start only while started <= (v + max_staleness + 1) * B, where
    v is the policy version generators have been told about (raised after each publish).
  * The learner takes B groups no older than v - max_staleness, checking each as it reads
    it in arrival order (older ones are dropped, their admission slot given back), trains
    for `train_step` seconds, and every `sync_every` steps publishes weights: `sync`
    seconds of learner time (export), then the generators pause `sync_pause` seconds to
    load them. As in asyncrl.control.loop, the async learner goes on while they load; the
    synchronous one waits for it.
  * max_staleness = 0 is the synchronous trainer.

--from-peers: each realistic workload of a bench/peers.py report, with the costs asyncrl's runs
measured (see `from_peers`), simulated once as the sync trainer (checked against the measured
sync run) and once as async with the learner on its own device; the projected useful tokens/s
is set against the best TRL peer's measured figure.

Last line printed: JSON with the key figures. bench/e2e.py validates the model against
real runs on this machine (`validate_simulator`, in the same run as the measurements).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace


@dataclass
class Scenario:
    generators: int = 1
    slots: int = 16
    parallel: float = 8.0
    """Groups a generator runs at full speed; more share its compute."""
    gen_mean: float = 1.0
    """Mean seconds to generate one group."""
    gen_cv: float = 0.3
    """Coefficient of variation of group generation time (long tails: > 1)."""
    gen_samples: list[float] = field(default_factory=list)
    """Measured group times; when given they replace the lognormal."""
    train_step: float = 1.0
    sync: float = 0.05
    sync_pause: float = 0.05
    sync_every: int = 1
    groups_per_step: int = 8
    max_staleness: int = 1
    steps: int = 200
    seed: int = 0


@dataclass
class Result:
    steps_per_s: float
    groups_per_s: float
    staleness_mean: float
    staleness_max: int
    staleness_hist: dict[int, float]
    dropped_stale: int
    learner_busy_frac: float
    generator_busy_frac: float
    wall_s: float


def _sampler(s: Scenario, rng: random.Random):
    if s.gen_samples:
        samples = list(s.gen_samples)
        return lambda: rng.choice(samples)
    sigma2 = math.log(1 + s.gen_cv**2)
    mu = math.log(s.gen_mean) - sigma2 / 2
    return lambda: rng.lognormvariate(mu, math.sqrt(sigma2))


def simulate(s: Scenario) -> Result:
    """Event-driven run of `s.steps` learner steps; returns throughput and staleness."""
    rng = random.Random(s.seed)
    draw = _sampler(s, rng)
    overlap = s.max_staleness > 0  # the loop's rule: only async loads weights while training
    now = 0.0
    events: list[tuple[float, int, str, tuple]] = []
    seq = 0

    def push(t: float, kind: str, *payload) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    version = 0  # learner's policy version
    announced = 0  # version admission sees (raised after a publish)
    published = 0  # weights the generators run
    started = 0
    paused_until = 0.0
    queue: list[int] = []  # behavior versions, FIFO
    learner_busy = False
    learner_busy_time = 0.0
    gen_busy_time = 0.0
    dropped = 0
    staleness: list[int] = []
    steps_done = 0

    # Processor sharing per generator: active[g] = list of [remaining_work, behavior_version].
    active: list[list[list[float]]] = [[] for _ in range(s.generators)]
    last_update = [0.0] * s.generators
    epoch = [0] * s.generators

    def rate(g: int) -> float:
        k = len(active[g])
        return 1.0 if k <= s.parallel else s.parallel / k

    def advance(g: int, t: float) -> None:
        """Progress generator g's groups up to time t (nothing moves during a sync pause)."""
        nonlocal gen_busy_time
        dt = t - last_update[g]
        if dt <= 0:
            return
        if active[g]:
            r = rate(g)
            for item in active[g]:
                item[0] -= dt * r
            gen_busy_time += dt * min(len(active[g]), s.parallel) / s.parallel
        last_update[g] = t

    def reschedule(g: int, t: float) -> None:
        epoch[g] += 1
        if active[g]:
            start = max(t, paused_until)
            push(start + max(0.0, min(i[0] for i in active[g])) / rate(g), "gen_check", g, epoch[g])

    def try_start(t: float) -> None:
        nonlocal started
        budget = (announced + s.max_staleness + 1) * s.groups_per_step
        for g in range(s.generators):
            changed = False
            advance(g, t)
            while len(active[g]) < s.slots and started < budget:
                active[g].append([draw(), published])
                started += 1
                changed = True
            if changed:
                reschedule(g, t)

    def try_train(t: float) -> None:
        nonlocal learner_busy, dropped, started
        if learner_busy:
            return
        # Each group is checked as it is read, in arrival order, as RolloutQueue.get_batch
        # does: arrival order is not version order (a long group admitted early finishes
        # behind fresher ones), so a stale group can sit anywhere in the queue.
        oldest_ok = version - s.max_staleness
        batch: list[int] = []
        while queue and len(batch) < s.groups_per_step:
            behavior = queue.pop(0)
            if behavior < oldest_ok:
                dropped += 1
                started -= 1  # the slot is given back, as the real loop does
            else:
                batch.append(behavior)
        if len(batch) < s.groups_per_step:
            queue[:0] = batch
            try_start(t)
            return
        staleness.extend(version - b for b in batch)
        learner_busy = True
        duration = s.train_step
        if (version + 1) % s.sync_every == 0:
            duration += s.sync + (0.0 if overlap else s.sync_pause)
        push(t + duration, "train_done")

    try_start(now)
    while events and steps_done < s.steps:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "gen_check":
            g, ep = payload
            if ep != epoch[g]:
                continue  # superseded by a later change on this generator
            advance(g, now)
            done = [i for i in active[g] if i[0] <= 1e-9]
            active[g] = [i for i in active[g] if i[0] > 1e-9]
            queue.extend(int(b) for _, b in done)
            reschedule(g, now)
            try_start(now)
            try_train(now)
        elif kind == "train_done":
            learner_busy = False
            steps_done += 1
            version += 1
            learner_busy_time += s.train_step
            if version % s.sync_every == 0:
                for g in range(s.generators):
                    advance(g, now)
                published = version
                # In-flight groups pause, they are not dropped. The synchronous learner's
                # step already included the load, its engines idle.
                paused_until = now + (s.sync_pause if overlap else 0.0)
                for g in range(s.generators):
                    last_update[g] = paused_until
                    reschedule(g, now)
            announced = version
            try_start(now)
            try_train(now)

    wall = max(now, 1e-9)
    hist: dict[int, float] = {}
    for v in staleness:
        hist[v] = hist.get(v, 0) + 1 / len(staleness)
    return Result(
        steps_per_s=steps_done / wall,
        groups_per_s=steps_done * s.groups_per_step / wall,
        staleness_mean=statistics.fmean(staleness) if staleness else 0.0,
        staleness_max=max(staleness, default=0),
        staleness_hist=dict(sorted(hist.items())),
        dropped_stale=dropped,
        learner_busy_frac=learner_busy_time / wall,
        generator_busy_frac=gen_busy_time / (wall * s.generators),
        wall_s=wall,
    )


def speedup_table(base: Scenario, bounds=(1, 2, 4)) -> dict[str, dict]:
    sync = simulate(Scenario(**{**asdict(base), "max_staleness": 0}))
    out = {"sync": asdict(sync)}
    for k in bounds:
        r = simulate(Scenario(**{**asdict(base), "max_staleness": k}))
        out[f"async_s{k}"] = {**asdict(r), "speedup": r.steps_per_s / sync.steps_per_s}
    return out


def from_peers(report: dict, workload: str, slots: int = 16, max_staleness: int = 2, steps: int = 400) -> dict:
    """Project asyncrl async with its learner on its own device from one bench/peers.py workload.

    The costs come from the sync run, where each phase has the box to itself: a step's
    generation (`time/wait_data`: the learner idles meanwhile; one measured value per steady
    step, drawn as that step's group time), the learner's train plus the step's own overhead
    (`time/step` - wait - `time/sync`), the export (`time/sync` - load) and the engines' load
    (`sync/apply_s`). Generation is modelled conservatively: a step's groups run together in the
    measured time and more groups in flight only share it (`parallel` = groups per step), so
    the engine makes groups no faster than sync measured. Async overlaps the two phases, as a
    learner with its own device would; on a shared box they take each other's cores. Useful
    tokens per step: sync's and, where the async run's policy emits a different length, async's
    own (its per-step cost from sync's longer completions makes that a lower bound)."""
    e = report["workloads"][workload]
    tr = e["trainers"]
    sync, ours = tr["asyncrl_sync"], tr["asyncrl_async"]
    prof = sync["profile"]
    gpst = e["spec"]["prompts_per_step"]
    waits = [
        w
        for r in sync["runs"]
        if not r["error"]
        for w in r.get("profile_steps", {}).get("time/wait_data", [])
        if w is not None
    ] or [prof["time/wait_data"]["mean"]]
    # Sync's time/sync is the export and the engines' load (it waits for them); async goes on
    # while they load, so the simulator takes them apart.
    load = prof.get("sync/apply_s", {"mean": 0.0})["mean"]
    publish = max(prof["time/sync"]["mean"] - load, 0.0)
    train = prof["time/step"]["mean"] - prof["time/wait_data"]["mean"] - prof["time/sync"]["mean"]
    base = Scenario(
        generators=1,
        slots=slots,
        parallel=float(gpst),
        gen_samples=waits,
        train_step=train,
        sync=publish,
        sync_pause=load,
        groups_per_step=gpst,
        steps=steps,
    )
    as_sync = simulate(replace(base, max_staleness=0))
    own = simulate(replace(base, max_staleness=max_staleness))
    trl = {k: v["useful_tokens_per_s"] for k, v in tr.items() if k.startswith("trl") and not v["error"]}
    best = max(trl, key=lambda k: trl[k]) if trl else None
    out = {
        "costs_s": {"generation": statistics.fmean(waits), "train": train, "publish": publish, "load": base.sync_pause},
        "sync_measured_steps_per_s": sync["steps_per_s"],
        "sync_simulated_steps_per_s": as_sync.steps_per_s,
        "async_measured_steps_per_s": ours["steps_per_s"],
        "async_own_device_steps_per_s": own.steps_per_s,
        "async_own_device_learner_busy": own.learner_busy_frac,
        "best_trl": best,
        "best_trl_useful_tokens_per_s": trl[best] if best else None,
    }
    for who, t in (("sync", sync), ("async", ours)):
        per_step = t["useful_tokens_per_s"] / t["steps_per_s"]
        out[f"useful_tokens_per_step_{who}"] = per_step
        out[f"async_own_device_useful_tokens_per_s_at_{who}_lengths"] = own.steps_per_s * per_step
        if best:
            out[f"ratio_vs_best_trl_at_{who}_lengths"] = own.steps_per_s * per_step / trl[best]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the built-in scenarios, a few seconds")
    p.add_argument("--smoke", action="store_true", help="the built-in scenarios at a tenth of the steps: < 2 s")
    for f in Scenario.__dataclass_fields__.values():
        if f.name in ("gen_samples",):
            continue
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    p.add_argument("--gen-samples", metavar="FILE", help="JSON list of measured group times (s)")
    p.add_argument("--from-peers", metavar="PEERS_JSON", help="project bench/peers.py's realistic workloads")
    args = p.parse_args(argv)
    if args.from_peers:
        with open(args.from_peers) as f:
            report = json.load(f)
        names = [n for n in report["workloads"] if n.startswith("realistic")]
        proj = {
            n: {k: round(v, 3) if isinstance(v, float) else v for k, v in from_peers(report, n).items()} for n in names
        }
        for n, r in proj.items():
            print(f"{n}: {json.dumps(r)}", file=sys.stderr)
        print(json.dumps(proj))
        return

    if args.quick or args.smoke:
        scenarios = {
            # Shaped like the CPU demo: generation and training of similar cost.
            "demo_like": Scenario(
                generators=1, slots=16, gen_mean=1.2, gen_cv=0.3, train_step=0.6, groups_per_step=8, steps=300
            ),
            # Long-tailed responses: a few groups take many times the mean.
            "long_tail": Scenario(
                generators=1, slots=16, gen_mean=1.2, gen_cv=1.5, train_step=0.6, groups_per_step=8, steps=300
            ),
            # 7B-like cluster we cannot run here: 64 generators, slow long generations.
            "cluster_7b": Scenario(
                generators=64,
                slots=8,
                gen_mean=60.0,
                gen_cv=0.8,
                train_step=40.0,
                sync=5.0,
                sync_pause=2.0,
                groups_per_step=512,
                steps=100,
            ),
        }
        if args.smoke:
            scenarios = {k: replace(sc, steps=max(10, sc.steps // 10)) for k, sc in scenarios.items()}
        report = {name: speedup_table(sc) for name, sc in scenarios.items()}
        for name, table in report.items():
            line = ", ".join(
                f"{k}: {v.get('speedup', 1.0):.2f}x (stale {v['staleness_mean']:.2f})" for k, v in table.items()
            )
            print(f"{name:>11}: {line}", file=sys.stderr)
        summary = {name: {k: round(v.get("speedup", 1.0), 3) for k, v in t.items()} for name, t in report.items()}
        checks = {
            # The model's own invariants: the synchronous trainer never trains a stale group, and
            # every mode finishes its steps at a positive rate.
            "sync_never_stale": all(t["sync"]["staleness_mean"] == 0 for t in report.values()),
            "all_modes_ran": all(v["steps_per_s"] > 0 for t in report.values() for v in t.values()),
        }
        print(json.dumps({"speedups": summary, "checks": checks}))
        return
    if args.gen_samples:
        with open(args.gen_samples) as f:
            args.gen_samples = json.load(f)
    sc = Scenario(**{k: getattr(args, k) for k in Scenario.__dataclass_fields__ if getattr(args, k) is not None})
    print(json.dumps(asdict(simulate(sc))))


if __name__ == "__main__":
    main()
