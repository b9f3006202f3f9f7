"""Replay-queue throughput and put->get latency, against the raw Redis transport on the same server.

    .venv/bin/python bench/queue.py --quick          # < 60 s; last line printed is JSON
    .venv/bin/python bench/queue.py --batch 16       # producers use put_many(16) / 16-deep pipelines
    .venv/bin/python bench/queue.py --smoke          # one small configuration, seconds (the test suite's)

For 2,048-token groups with n = 1 and 8 samples, and 1 and 4 producer processes, it measures:
  ours      producers call RolloutQueue.put (encode + one Lua XADD round trip each), the
            consumer calls get_batch (XREADGROUP + decode + validate) and ack (XACK + XDEL);
  raw loop  the same processes and payload size with no codec: pre-encoded bytes, XADD
            (pipelined `--batch` deep), XREADGROUP, XACK + XDEL. Like for like with ours;
  redis-benchmark  (if the binary exists; installed from Debian's redis-tools with apt-get when
            missing and running as root, unless --no-install) XADD only, one client per
            producer, of the same payload: the C client's write-only ceiling.
`ratio` = ours / baseline groups/s summed over configurations, baseline being redis-benchmark
when present (the C client's write ceiling is the fairest bar), else the raw loop; `ratio_vs_raw_loop` is always given.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# standard library's `queue` (which redis-py and multiprocessing import): drop that entry.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse
import contextlib
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import tempfile
import time

import numpy as np
import redis
from rich.console import Console
from rich.progress import Progress

from asyncrl.data.codec import encode_group
from asyncrl.queue import RolloutQueue, keys
from asyncrl.queue.server import EmbeddedRedis
from asyncrl.types import RolloutGroup, Sample
from bench.jsonout import JsonStdout

MAXLEN = 512  # bounds Redis memory: 512 x ~150 KB records


def make_group(n_samples: int, tokens: int, group_id: str) -> RolloutGroup:
    rng = np.random.default_rng(0)
    samples = [
        Sample(rng.integers(0, 32000, tokens), -rng.random(tokens, dtype=np.float32), np.ones(tokens), 1.0, 0)
        for _ in range(n_samples)
    ]
    return RolloutGroup(group_id, "p", rng.integers(0, 32000, 128), samples, metadata={"t": 0.0})


def _start_together(ready, seconds: float) -> float:
    """Wait until every producer and the consumer are set up; returns the end of the window."""
    ready.wait()
    return time.time() + seconds


def produce_ours(url: str, run: str, n_samples: int, tokens: int, ready, seconds: float, batch: int, tag: str) -> None:
    q = RolloutQueue.connect(url, run, maxlen=MAXLEN)
    group = make_group(n_samples, tokens, "")
    t1 = _start_together(ready, seconds)
    i = 0
    while time.time() < t1:
        out = []
        for _ in range(batch):
            out.append(RolloutGroup(f"{tag}-{i}", "p", group.prompt_ids, group.samples, metadata={"t": time.time()}))
            i += 1
        if batch == 1:
            q.put(out[0])
        else:
            q.put_many(out)
    q.close()


def produce_raw(url: str, run: str, payload_size: int, ready, seconds: float, batch: int) -> None:
    r = redis.Redis.from_url(url)
    stream = keys.rollouts(run)
    body = os.urandom(payload_size - 8)
    t1 = _start_together(ready, seconds)
    while time.time() < t1:
        # the same backpressure rule as ours, checked once per batch
        while r.xlen(stream) >= MAXLEN and time.time() < t1:
            time.sleep(0.002)
        pipe = r.pipeline(transaction=False)
        for _ in range(batch):
            pipe.xadd(stream, {keys.RECORD_FIELD: np.float64(time.time()).tobytes() + body})
        pipe.execute()
    r.close()


def consume(kind: str, url: str, run: str, t0: float, t1: float) -> tuple[int, list[float]]:
    """Read until t1 (+ drain); returns groups received in [t0, t1] and their latencies."""
    latencies: list[float] = []
    received = 0
    if kind == "ours":
        q = RolloutQueue.connect(url, run, maxlen=MAXLEN)
        while time.time() < t1 + 0.5:
            items = q.get_batch(64, 0, timeout=0.1)
            now = time.time()
            q.ack([i for i, _ in items])
            for _, g in items:
                if t0 <= now <= t1:
                    received += 1
                    latencies.append(now - g.metadata["t"])
        q.close()
        return received, latencies
    r = redis.Redis.from_url(url)
    stream = keys.rollouts(run)
    with contextlib.suppress(redis.ResponseError):
        r.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
    while time.time() < t1 + 0.5:
        resp = r.xreadgroup(keys.CONSUMER_GROUP, "raw", {stream: ">"}, count=64, block=100)
        entries = resp[0][1] if resp else []
        now = time.time()
        if entries:
            ids = [e[0] for e in entries]
            pipe = r.pipeline(transaction=True)
            pipe.xack(stream, keys.CONSUMER_GROUP, *ids)
            pipe.xdel(stream, *ids)
            pipe.execute()
        for _, fields in entries:
            if t0 <= now <= t1:
                received += 1
                latencies.append(now - float(np.frombuffer(fields[keys.RECORD_FIELD][:8], np.float64)[0]))
    r.close()
    return received, latencies


def run_config(
    kind: str, url: str, n_samples: int, tokens: int, producers: int, seconds: float, batch: int, payload_size: int
) -> dict:
    run = f"bench-{kind}-{n_samples}-{producers}-{int(time.time() * 1000) % 10**8}"
    RolloutQueue.connect(url, run, maxlen=MAXLEN).close()  # creates the stream and group
    ctx = mp.get_context("spawn")
    ready = ctx.Barrier(producers + 1)  # spawned producers import for seconds on a small box
    if kind == "ours":
        procs = [
            ctx.Process(target=produce_ours, args=(url, run, n_samples, tokens, ready, seconds, batch, f"p{k}"))
            for k in range(producers)
        ]
    else:
        procs = [
            ctx.Process(target=produce_raw, args=(url, run, payload_size, ready, seconds, batch))
            for _ in range(producers)
        ]
    for p in procs:
        p.start()
    ready.wait(120)
    t0 = time.time()
    t1 = t0 + seconds
    received, lat = consume(kind, url, run, t0, t1)
    for p in procs:
        p.join(30)
    r = redis.Redis.from_url(url)
    r.delete(keys.rollouts(run), keys.counters(run), keys.state(run))
    r.srem(keys.RUNS, run)
    lat_ms = np.array(lat) * 1000 if lat else np.array([np.nan])
    return {
        "kind": kind,
        "samples": n_samples,
        "producers": producers,
        "batch": batch,
        "received": received,
        "groups_per_s": received / seconds,
        "mb_per_s": received * payload_size / seconds / 1e6,
        "p50_ms": float(np.percentile(lat_ms, 50)),
        "p99_ms": float(np.percentile(lat_ms, 99)),
    }


def find_redis_benchmark(install: bool, console: Console) -> str | None:
    path = shutil.which("redis-benchmark")
    if path or not install or os.geteuid() != 0 or not shutil.which("apt-get"):
        return path
    console.print("[dim]installing redis-tools (redis-benchmark) with apt-get...[/dim]")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "redis-tools"]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        subprocess.run(cmd, env=env, capture_output=True)
    return shutil.which("redis-benchmark")


def redis_benchmark_xadd(binary: str, server: EmbeddedRedis, payload_size: int, clients: int, seconds: float) -> float:
    """XADD ops/s from redis-benchmark (payload fed on stdin with -x: it can exceed one argv string)."""
    with tempfile.NamedTemporaryFile() as f:
        f.write(b"x" * payload_size)
        f.flush()
        f.seek(0)

        # a short calibration run sizes -n to about `seconds`
        def once(n: int) -> float:
            f.seek(0)
            out = subprocess.run(
                [
                    binary,
                    "-h",
                    server.host,
                    "-p",
                    str(server.port),
                    "-c",
                    str(clients),
                    "-n",
                    str(n),
                    "-q",
                    "-x",
                    "XADD",
                    "asyncrl:bench:rb",
                    "MAXLEN",
                    "~",
                    str(MAXLEN),
                    "*",
                    "d",
                ],
                stdin=f,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            rates = re.findall(r"([\d.]+) requests per second", out.replace("\r", "\n"))
            return float(rates[-1])

        rate = once(200)
        rate = once(max(200, int(rate * seconds)))
    redis.Redis.from_url(server.url).delete("asyncrl:bench:rb")
    return rate


def main() -> None:
    with JsonStdout() as out:
        out.result = run()


def run() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short runs (< 60 s in all)")
    ap.add_argument("--smoke", action="store_true", help="n=1, one producer, 256 tokens, 1 s each, no redis-benchmark")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per configuration")
    ap.add_argument("--batch", type=int, default=1, help="groups per put_many / XADDs per pipeline")
    ap.add_argument("--no-install", action="store_true", help="never apt-get redis-tools")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.seconds = 256, args.seconds or 1.0
    seconds = args.seconds or (2.0 if args.quick else 8.0)
    console = Console(stderr=True)
    rb = None if args.smoke else find_redis_benchmark(not args.no_install, console)
    configs = [(1, 1)] if args.smoke else [(n, p) for n in (1, 8) for p in (1, 4)]
    rows, rb_rates = [], {}
    with (
        tempfile.TemporaryDirectory() as d,
        EmbeddedRedis(Path(d) / "redis") as server,
        Progress(console=console) as progress,
    ):
        task = progress.add_task("queue bench", total=len(configs) * (3 if rb else 2))
        for n, p in configs:
            size = len(encode_group(make_group(n, args.tokens, "p0-000000")))
            for kind in ("ours", "raw"):
                progress.update(task, description=f"{kind}: n={n} producers={p}")
                rows.append(
                    {**run_config(kind, server.url, n, args.tokens, p, seconds, args.batch, size), "record_bytes": size}
                )
                progress.advance(task)
            if rb:
                progress.update(task, description=f"redis-benchmark: n={n} clients={p}")
                rb_rates[(n, p)] = redis_benchmark_xadd(rb, server, size, p, min(seconds, 2.0))
                progress.advance(task)
    for row in rows:
        if row["kind"] == "raw":
            console.print(
                f"raw  n={row['samples']} P={row['producers']}: {row['groups_per_s']:8.0f} groups/s "
                f"p50 {row['p50_ms']:.1f} ms  p99 {row['p99_ms']:.1f} ms"
            )
        else:
            console.print(
                f"ours n={row['samples']} P={row['producers']}: {row['groups_per_s']:8.0f} groups/s "
                f"p50 {row['p50_ms']:.1f} ms  p99 {row['p99_ms']:.1f} ms  ({row['record_bytes']} B/record)"
            )
    for (n, p), rate in rb_rates.items():
        console.print(f"redis-benchmark XADD n={n} clients={p}: {rate:8.0f} ops/s")
    ours = sum(r["groups_per_s"] for r in rows if r["kind"] == "ours")
    raw = sum(r["groups_per_s"] for r in rows if r["kind"] == "raw")
    rb_total = sum(rb_rates.values())
    baseline, base = ("redis-benchmark XADD", rb_total) if rb else ("raw pipelined XADD + XREADGROUP loop", raw)
    return {
        "groups_per_s": ours,
        "baseline": baseline,
        "baseline_ops_per_s": base,
        "ratio": ours / base if base else None,
        "raw_loop_ops_per_s": raw,
        "ratio_vs_raw_loop": ours / raw if raw else None,
        "redis_benchmark_xadd": {f"n{n}_c{p}": v for (n, p), v in rb_rates.items()},
        "tokens": args.tokens,
        "batch": args.batch,
        "seconds_per_config": seconds,
        "configs": rows,
        # Every configuration moved groups both ways, and ours arrived intact (decoded, validated).
        "checks": {f"{r['kind']}_n{r['samples']}_p{r['producers']}_received": r["received"] > 0 for r in rows},
    }


if __name__ == "__main__":
    main()
