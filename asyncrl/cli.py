"""`asyncrl` command line.

    asyncrl train configs/demo.yaml control.max_staleness=2 learner.lr=3e-4
    asyncrl train --resume runs/demo
    asyncrl train --help-config                  # every config field: type, default, description
    asyncrl generate --redis redis://127.0.0.1:6379/0 --run demo      # join a running job
    asyncrl generate --redis URL --run demo --ray-address ray://HEAD:10001   # from another host
    asyncrl dashboard --redis redis://127.0.0.1:6379/0 [--run demo] [--port 8470]   # a live run
    asyncrl dashboard runs/demo [--host 127.0.0.1] [--port 8470]                    # a finished run
    asyncrl bench e2e --quick
    asyncrl tiny-model /tmp/tiny

The config is parsed and validated before torch, Ray or vLLM are imported, so a bad flag
is rejected in about a second.

An expected failure (a bad config or path, a Redis or Ray cluster that does not answer) ends
every command with one line on stderr, ``asyncrl COMMAND: what failed``, and exit code 2 (bad
input) or 3 (unreachable: try again later); --verbose shows its traceback too. Anything else
is a bug and keeps its traceback.

SIGTERM (a scheduler's preemption or time limit, `kill`) stops `train` as Ctrl-C does, within
control.shutdown_grace_s: the step is finished or abandoned, a checkpoint written, everything
the run started stopped, the summary and resume command printed; the exit status is then 143,
which asks a scheduler to requeue the job (docs/guide/clusters.md). `generate` drains its
in-flight groups and leaves with 143 too. Whatever ends either command, a lifeline process
(asyncrl.lifeline) stops what it started (Redis, Ray, engine processes) once it is gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError, load_config, redact_config, schema_text
from asyncrl.control.allowlist import ImportAllowList
from asyncrl.control.elastic import run_elastic_generator
from asyncrl.control.preflight import preflight
from asyncrl.control.preflight_gpu import cannot_start_here, cuda_devices
from asyncrl.control.state import PREEMPTED_EXIT
from asyncrl.control.train import train
from asyncrl.infra import run_command
from asyncrl.lifeline import Lifeline
from asyncrl.queue.signing import normalise_fingerprint
from asyncrl.rollout.tiny import ARCHS, write_tiny_model
from asyncrl.rundir import CONFIG_FILE
from asyncrl.rundir.store import is_url

BENCHES = ("queue", "learner", "sync", "generate", "e2e", "simulate", "soak", "peers")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    verbose = "debug logging, and every Ray worker's and vLLM engine's output on the console"
    p.add_argument("-v", "--verbose", action="store_true", help=verbose)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str, **kwargs: Any) -> argparse.ArgumentParser:
        """A subcommand whose own --help opens with the line `asyncrl --help` lists it by."""
        return sub.add_parser(name, help=text, description=text, **kwargs)

    t = command("train", "run a training job (async or sync mode)")
    t.add_argument("config", nargs="?", help="YAML config (see configs/)")
    t.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    t.add_argument("--resume", metavar="RUN_DIR", help="resume from RUN_DIR's last checkpoint")
    t.add_argument("--check", action="store_true", help="validate the config, print it, and exit")
    t.add_argument(
        "--help-config",
        action="store_true",
        help="print every config section and field (type, default, description) and every policy loss, and exit",
    )
    # Also after the subcommand (`asyncrl train cfg.yaml --verbose`); SUPPRESS keeps `asyncrl -v train`.
    t.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose)

    g = command("generate", "join a running job as an elastic generator")
    g.add_argument("--redis", required=True, metavar="URL", help="the job's Redis URL (the trainer logs it)")
    g.add_argument("--run", required=True, metavar="NAME", help="the job's run name (control.run_name)")
    g.add_argument(
        "--password",
        default=os.environ.get("ASYNCRL_REDIS_PASSWORD"),
        help="the Redis password when the URL has none (default: $ASYNCRL_REDIS_PASSWORD)",
    )
    g.add_argument("--id", dest="generator_id", default=None, help="generator id (default: host-pid)")
    g.add_argument("--max-groups", type=int, default=None, help="leave after producing this many groups")
    g.add_argument(
        "--ray-address",
        default=None,
        help="the job's Ray cluster, needed where weights travel through Ray (multi-node): "
        "ray://HEAD:10001 (Ray Client, nothing else to run here) or auto/HEAD:PORT on a "
        "host that joined the cluster with `ray start`",
    )
    # The job's config comes from Redis: code it names is loaded only if this host allows it.
    g.add_argument(
        "--allow-import",
        action="append",
        default=[],
        metavar="MODULE:NAME",
        help="an import path (environment, reward function, custom loss) the job's config may load; repeatable",
    )
    g.add_argument(
        "--allow-imports-from",
        action="append",
        default=[],
        metavar="CONFIG",
        help="a config file on this host (e.g. the job's own YAML): every import path it names is allowed",
    )
    g.add_argument(
        "--allow-engine-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a vLLM engine setting (rollout.engine_kwargs) taken with any value beyond the safe ones "
        "(docs/security.md); repeatable",
    )
    g.add_argument(
        "--allow-prompts",
        action="append",
        default=[],
        metavar="SOURCE",
        help="a prompt source (file, dataset directory or hub id) the job's rollout.prompts may name; repeatable",
    )
    g.add_argument(
        "--trust-key",
        default=None,
        metavar="FINGERPRINT",
        help="the trainer key's fingerprint (the trainer logs it): refuse a job config it did not sign",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow rollout.engine_kwargs.trust_remote_code (the model folder's own Python code)",
    )
    g.add_argument(
        "--connect-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long to retry the job's Redis before giving up (default: 30)",
    )
    g.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose)

    # The dashboard parses its own arguments (asyncrl.monitor.dashboard.__main__), so that
    # `python -m asyncrl.monitor.dashboard` is the same command and needs nothing from here.
    command("dashboard", "serve the staleness/drift dashboard (a live run's Redis or a run dir)", add_help=False)

    b = command("bench", f"run a benchmark from bench/ ({', '.join(BENCHES)})")
    b.add_argument(
        "name", choices=BENCHES, help="the benchmark (bench/NAME.py; bench/README.md says what each measures)"
    )
    b.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark (e.g. --quick)")

    e = command("export", "write a Hugging Face folder (save_pretrained) from a run's checkpoint")
    e.add_argument("run_dir", help="the run directory (control.run_dir)")
    e.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    e.add_argument("--out", default=None, help="where to write it (default: RUN_DIR/hf/step_N)")
    e.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: the adapter alone in PEFT format (default: base + adapter merged)",
    )
    e.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose)

    m = command("tiny-model", "write a tiny random model (a Llama by default) + char tokenizer")
    m.add_argument("path", help="the directory to write it to")
    m.add_argument("--arch", default="llama", choices=sorted(ARCHS), help="the model family (docs/guide/models.md)")
    m.add_argument("--seed", type=int, default=0, help="the random weights' seed (default: 0)")
    m.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose)
    return p


def _cmd_train(args) -> int:
    if args.help_config:
        print(schema_text(), end="")
        return 0
    # ConfigError and PromptSourceError are expected failures: run_command prints their one line.
    if args.resume:
        # With --resume the positional CONFIG slot holds the first override, if any.
        overrides = ([args.config] if args.config else []) + args.overrides
        _check_run_dir(args.resume)
        # Joined as text: RUN_DIR may be a URL (s3://...), which pathlib would mangle.
        cfg = load_config(f"{args.resume.rstrip('/')}/{CONFIG_FILE}", overrides)
    else:
        if not args.config:
            print("asyncrl train: a CONFIG file (or --resume RUN_DIR) is required", file=sys.stderr)
            return 2
        cfg = load_config(args.config, args.overrides)
    if args.verbose:
        cfg.monitor.verbose = True
    if args.check:
        import yaml

        print(yaml.safe_dump(redact_config(cfg), sort_keys=False))  # terminals and CI logs: no secrets

        for line in preflight(cfg):
            print(f"check: {line}")
        reason = cannot_start_here(cfg, cuda_devices())
        if reason is not None:
            print(f"asyncrl train --check: the run cannot start here: {reason}", file=sys.stderr)
            return 2
        return 0

    # The weights a killed run leaves in shm_dir go with it (a clean stop deletes them itself).
    weights = os.path.join(cfg.sync.shm_dir, f"asyncrl-{cfg.control.run_name}-v*.safetensors*")
    with Lifeline.start(shm_globs=[weights]):
        train(cfg, resume_dir=args.resume)
    return 0


def _check_run_dir(run_dir: str) -> None:
    """A local --resume RUN_DIR exists and holds a run's config (a URL is read by load_config)."""
    if is_url(run_dir):
        return
    if not os.path.isdir(run_dir):
        raise ConfigError(f"--resume {run_dir!r}: the run directory does not exist")
    if not os.path.isfile(os.path.join(run_dir, CONFIG_FILE)):
        raise ConfigError(f"--resume {run_dir!r}: not a run directory (no {CONFIG_FILE})")


def _cmd_generate(args) -> int:
    allowed = ImportAllowList.build(
        args.allow_import,
        args.allow_imports_from,
        args.trust_remote_code,
        engine_keys=args.allow_engine_key,
        prompt_sources=args.allow_prompts,
    )
    try:
        trust_key = normalise_fingerprint(args.trust_key) if args.trust_key is not None else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    with Lifeline.start():
        stats = run_elastic_generator(
            args.redis,
            args.run,
            password=args.password,
            generator_id=args.generator_id,
            max_groups=args.max_groups,
            ray_address=args.ray_address,
            connect_timeout_s=args.connect_timeout,
            allowed=allowed,
            trust_key=trust_key,
        )
    return PREEMPTED_EXIT if stats.get("stopped_by") == "SIGTERM" else 0


def _cmd_dashboard(args) -> int:
    # The dashboard (starlette, uvicorn) and export (torch) are imported only by their own
    # commands: `asyncrl train --check` and `--help-config` must start without them.
    from asyncrl.monitor.dashboard.__main__ import main as dashboard_main

    return dashboard_main(args.dashboard_argv + (["--verbose"] if args.verbose else []))


def _cmd_bench(args) -> int:
    script = Path(__file__).resolve().parent.parent / "bench" / f"{args.name}.py"
    if not script.exists():
        print(f"asyncrl bench: {script} not found (benchmarks run from a source checkout)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _cmd_export(args) -> int:
    from asyncrl.control.export import export_checkpoint

    try:
        out = export_checkpoint(args.run_dir, step=args.step, out=args.out, adapter=args.adapter)
    except (FileNotFoundError, ValueError) as e:
        print(f"asyncrl export: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _cmd_tiny_model(args) -> int:
    print(write_tiny_model(args.path, arch=args.arch, seed=args.seed))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may come before or after flags (`train cfg.yaml --check a.b=1`).
    if args.command == "dashboard":
        args.dashboard_argv = extra
    elif extra and args.command == "train" and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    handlers = {
        "train": _cmd_train,
        "generate": _cmd_generate,
        "dashboard": _cmd_dashboard,
        "bench": _cmd_bench,
        "export": _cmd_export,
        "tiny-model": _cmd_tiny_model,
    }
    command = handlers[args.command]
    return run_command(f"asyncrl {args.command}", lambda: command(args), verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
