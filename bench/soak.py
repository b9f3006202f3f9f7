"""Soak: the CPU demo trains for N minutes while faults hit it at random times; at the end the
exactly-once ledger must balance (nothing lost, nothing trained twice).

    .venv/bin/python bench/soak.py --quick            # ~3 minutes of faults
    .venv/bin/python bench/soak.py --minutes 30 --seed 1
    asyncrl bench soak --quick
    .venv/bin/python bench/soak.py --smoke            # one connection drop, then stop and audit (the test suite's)

Faults (drawn uniformly, one every --fault-every seconds on average, exponential gaps):
  generator_kill   SIGKILL the generator actor mid-generation (Ray restarts it)
  redis_restart    SIGKILL redis-server, start it again on its AOF (same port)
  connection_drop  CLIENT KILL TYPE normal, then CLIENT PAUSE 3 s
  trainer_kill     SIGKILL the whole trainer process group, then `asyncrl train --resume`
A fault counts as survived when the job trains past it (see recovery_target) within
--recover-timeout s.
At the end the job is stopped with SIGINT (checkpoint, exit 0) and audited. A live table
shows progress; the last line printed is JSON with the figures. Exit 1 if a fault was not
survived or the ledger does not balance.

Growth: every few seconds the trainer process's RSS and the size of the newest checkpoint
(its directory, and its `extra.msgpack` alone) are sampled against the trainer step; the
result has each one's least-squares slope in bytes per step (RSS over the longest-lived
trainer process, since a trainer_kill starts a fresh one). A bounded run shows ~0 for the
checkpoint and a small, flattening RSS slope.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
# bench/ itself must not be on sys.path (bench/queue.py would shadow the stdlib queue).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rich.console import Console, Group  # noqa: E402
from rich.live import Live  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.jsonout import JsonStdout  # noqa: E402
from tests.support.job import JobDied, TrainJob  # noqa: E402

FAULTS = ("generator_kill", "redis_restart", "connection_drop", "trainer_kill")
OVERRIDES = [
    "control.checkpoint_every=3",
    "control.groups_per_step=4",
    "rollout.n_samples=4",
    "control.total_steps=1000000",
    "control.batch_timeout_s=300",
]


def inject(job: TrainJob, fault: str) -> str:
    """Apply one fault; returns a short note of what was done."""
    if fault == "generator_kill":
        pids = job.pids_named("ray::GeneratorActor")
        if not pids:
            return "no generator process (restarting?): skipped"
        os.kill(pids[0], signal.SIGKILL)
        return f"killed generator pid {pids[0]}"
    if fault == "redis_restart":
        return f"redis-server restarted as pid {job.restart_redis(down_s=1.0)}"
    if fault == "connection_drop":
        return f"{job.drop_connections(pause_s=3.0)} connections killed, clients paused 3 s"
    if fault == "trainer_kill":
        at = job.trainer_step()
        job.signal(signal.SIGKILL)
        job.wait(60)
        job.resume()
        return f"trainer killed at step {at}, resumed"
    raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")


def recovery_target(fault: str, before: int) -> int:
    """The trainer step that proves the job recovered from `fault` injected at `before`.

    trainer_kill: one step past the killed trainer's step (the resumed trainer restarts from
    its checkpoint, below it, so anything lower proves nothing). generator_kill:
    past what admission let the dead generator queue ahead ((max_staleness + 1) steps of
    groups, 3 in the demo), so the restarted generator must have produced. Others: 2 steps.
    """
    return before + {"trainer_kill": 1, "generator_kill": 5}.get(fault, 2)


def sample_growth(job: TrainJob) -> dict | None:
    """{"step", "pid", "rss", "ckpt_bytes", "extra_bytes"} now, or None while unreadable."""
    from asyncrl.control.train import latest_checkpoint

    step = job.trainer_step()
    try:
        rss = psutil.Process(job.pid).memory_info().rss
        ckpt = latest_checkpoint(job.run_dir)
        if ckpt is None or step == 0:
            return None
        size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        extra = (ckpt / "extra.msgpack").stat().st_size
    except (psutil.Error, OSError):  # a checkpoint pruned or a trainer restarted meanwhile
        return None
    return {"step": step, "pid": job.pid, "rss": rss, "ckpt_bytes": size, "extra_bytes": extra}


def slope(samples: list[dict], key: str) -> float | None:
    """Least-squares bytes per trainer step of samples[key]; None with fewer than 3 distinct steps."""
    if len({s["step"] for s in samples}) < 3:
        return None
    return statistics.linear_regression([s["step"] for s in samples], [s[key] for s in samples]).slope


def growth(samples: list[dict]) -> dict:
    by_pid: dict[int, list[dict]] = {}
    for s in samples:
        by_pid.setdefault(s["pid"], []).append(s)
    longest = max(by_pid.values(), key=len, default=[])
    return {
        "trainer_rss_slope_bytes_per_step": slope(longest, "rss"),
        "checkpoint_slope_bytes_per_step": slope(samples, "ckpt_bytes"),
        "checkpoint_extra_slope_bytes_per_step": slope(samples, "extra_bytes"),
        "trainer_rss_mb_first_last": [round(longest[0]["rss"] / 2**20, 1), round(longest[-1]["rss"] / 2**20, 1)]
        if longest
        else None,
        "checkpoint_extra_bytes_first_last": [samples[0]["extra_bytes"], samples[-1]["extra_bytes"]]
        if samples
        else None,
        "growth_samples": len(samples),
    }


def view(job: TrainJob, events: list[dict], counts: dict, t_end: float) -> Group:
    """The live summary: run figures, then the last faults and how long recovery took."""
    c = job.counters()
    run = Table(title=f"asyncrl soak: {job.run_name}  ({max(0, t_end - time.monotonic()):.0f} s left)")
    for col in (
        "step",
        "policy version",
        "trained",
        "produced",
        "dropped stale",
        "dead-lettered",
        "faults ok/injected",
    ):
        run.add_column(col, justify="right")
    run.add_row(
        str(job.trainer_step()),
        str(job.policy_version()),
        str(c.get("groups_trained", "?")),
        str(c.get("groups_produced", "?")),
        str(c.get("dropped_stale", 0)),
        str(c.get("dead_lettered", 0)),
        f"{counts['survived']}/{counts['injected']}",
    )
    faults = Table(title="last faults")
    for col in ("at", "fault", "what", "outcome", "recovered in"):
        faults.add_column(col)
    for e in events[-8:]:
        outcome = "survived" if e.get("ok") else e.get("error", "recovering...")
        faults.add_row(
            f"{e['t']:.0f} s",
            e["fault"],
            e.get("note", ""),
            outcome,
            f"{e['recover_s']:.0f} s" if "recover_s" in e else "",
        )
    return Group(run, faults)


def soak(
    minutes: float,
    fault_every: float,
    seed: int,
    run_dir: Path,
    recover_timeout: float,
    faults: tuple[str, ...] = FAULTS,
    max_faults: int | None = None,
) -> dict:
    rng = random.Random(seed)
    job = TrainJob(ROOT / "configs" / "demo.yaml", OVERRIDES, run_dir=run_dir, run_name="soak")
    console = Console(stderr=True)
    events: list[dict] = []
    counts = {"injected": 0, "survived": 0, **{f: 0 for f in FAULTS}}
    samples: list[dict] = []
    next_sample = 0.0
    t_start = time.monotonic()
    try:
        job.start()
        job.wait_for_step(1, timeout=600)
        console.print(f"job up in {time.monotonic() - t_start:.0f} s; log: {job.log_path}")
        t0 = time.monotonic()
        t_end = t0 + minutes * 60
        with Live(view(job, events, counts, t_end), console=console, refresh_per_second=1) as live:
            while time.monotonic() < t_end and (max_faults is None or counts["injected"] < max_faults):
                next_at = time.monotonic() + rng.expovariate(1.0 / fault_every)
                while time.monotonic() < min(next_at, t_end):
                    time.sleep(1.0)
                    if not job.running():
                        raise JobDied(f"job died between faults:\n{job.log_tail()}")
                    if time.monotonic() >= next_sample:
                        if (sample := sample_growth(job)) is not None:
                            samples.append(sample)
                        next_sample = time.monotonic() + 5.0
                    live.update(view(job, events, counts, t_end))
                if time.monotonic() >= t_end:
                    break
                fault = rng.choice(faults)
                event = {"t": time.monotonic() - t0, "fault": fault}
                events.append(event)
                before = job.trainer_step()
                event["note"] = inject(job, fault)
                counts["injected"] += 1
                counts[fault] += 1
                t_fault = time.monotonic()
                try:
                    job.wait_for_step(recovery_target(fault, before), timeout=recover_timeout)
                    event["ok"] = True
                    counts["survived"] += 1
                except (TimeoutError, JobDied) as e:
                    event["error"] = type(e).__name__
                    console.print(f"[red]{fault} not survived: {e}")
                    break
                finally:
                    event["recover_s"] = time.monotonic() - t_fault
                live.update(view(job, events, counts, t_end))
        if job.running():
            job.signal(signal.SIGINT)  # graceful: finish the step, checkpoint, exit 0
            rc = job.wait(300)
        else:
            rc = job.proc.returncode
        ledger = job.audit()
        problems = ""
        try:
            ledger.check()
        except AssertionError as e:
            problems = str(e)
        summary = ledger.summary
        return {
            "minutes": round((time.monotonic() - t0) / 60, 2),
            "seed": seed,
            "exit_code": rc,
            "faults_injected": counts["injected"],
            "faults_survived": counts["survived"],
            "faults": {f: counts[f] for f in FAULTS},
            "steps": job.final_extra()["step"],
            "produced": summary["produced"],
            "trained": summary["trained"],
            "dropped_stale": summary["dropped_stale"],
            "dead_lettered": summary["dead_lettered"],
            "queued": summary["queued"],
            "lost": summary["lost"],
            "double_trained": summary["double_trained"],
            "ledger_ok": not problems,
            "ledger_problems": problems,
            **growth(samples),
            "run_dir": str(run_dir),
        }
    finally:
        job.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to inject faults")
    p.add_argument("--quick", action="store_true", help="3 minutes, a fault every ~25 s")
    p.add_argument("--fault-every", type=float, default=45.0, help="mean seconds between faults")
    p.add_argument("--recover-timeout", type=float, default=300.0, help="seconds to train 2 steps after a fault")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS, help="the kinds drawn from")
    p.add_argument("--smoke", action="store_true", help="one connection drop right after step 1, then stop")
    p.add_argument("--run-dir", type=Path, default=None, help="default: a new temp dir")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.fault_every = 3.0, 25.0
    max_faults = None
    if args.smoke:  # the cheapest fault, once, at once: the bench's loop, recovery wait and audit
        args.minutes, args.fault_every, args.faults, max_faults = 5.0, 0.01, ["connection_drop"], 1
        args.recover_timeout = min(args.recover_timeout, 180.0)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="asyncrl-soak-")) / "soak"
    with JsonStdout() as out:
        result = soak(
            args.minutes, args.fault_every, args.seed, run_dir, args.recover_timeout, tuple(args.faults), max_faults
        )
        result["checks"] = {
            "ledger_balances": result["ledger_ok"],
            "faults_survived": result["faults_survived"] == result["faults_injected"],
            "clean_exit": result["exit_code"] == 0,
        }
        out.result = result
        report(result)
    return 0 if all(result["checks"].values()) else 1


def report(result: dict) -> None:
    console = Console()
    console.print(f"faults survived: {result['faults_survived']}/{result['faults_injected']}  {result['faults']}")
    console.print(
        f"groups: produced {result['produced']}  trained {result['trained']}  dropped stale "
        f"{result['dropped_stale']}  dead-lettered {result['dead_lettered']}  queued {result['queued']}"
    )
    console.print(
        f"growth over {result['growth_samples']} samples (bytes per step): trainer RSS "
        f"{result['trainer_rss_slope_bytes_per_step']}, checkpoint {result['checkpoint_slope_bytes_per_step']}, "
        f"its extra {result['checkpoint_extra_slope_bytes_per_step']}"
    )
    console.print(
        f"lost {result['lost']} (must be 0)  double-trained {result['double_trained']} (must be 0)"
        + (f"\n[red]{result['ledger_problems']}" if result["ledger_problems"] else "")
    )


if __name__ == "__main__":
    sys.exit(main())
