"""The README and the guide stay true: every shell command in their fenced blocks parses, the
cheap ones run, and the expensive ones are covered by a test that already runs them.

A fenced block's info string says what its commands are:

    ```bash            run here: --help, --help-config, `asyncrl train CONFIG ... --check`,
                       `python scripts/config_reference.py --check` (nothing else is allowed)
    ```bash heavy      a training job or a finished run's command: cited in HEAVY below, by a
                       test that already runs it (the README's quickstart jobs are run as
                       written by tests/integration/test_readme_walkthrough.py; the rest
                       are jobs other tests run anyway)
    ```bash external   needs what CI lacks (GPUs, a running job's Redis, a bucket, a cluster)

Every `asyncrl` command in any of them is parsed by the real argument parsers (the subcommand
and each option must exist), and `asyncrl train CONFIG overrides` loads its config with those
overrides, on the Python path the command itself gives (`PYTHONPATH=.`) and no other, so a
command that needs `PYTHONPATH=.` and lacks it fails here. ```python file=PATH blocks must be
copied from PATH as they are. Relative links must point at files and headings that exist.
The `asyncrl train` commands in the examples' own docstrings (the README sends readers there)
pass `--check` too.

Cost: one in-process `--check` per runnable command (the first imports vLLM's engine
arguments, a few seconds; the rest well under a second each); no Ray, Redis or engine start.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import BaseModel

from asyncrl.cli import _parser, main
from asyncrl.config import Config, ConfigError, load_config
from asyncrl.config.help import section_type
from asyncrl.monitor.dashboard.__main__ import _parser as dashboard_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide"
DOCS = [README, ROOT / "docs" / "results.md", *sorted(GUIDE.glob("*.md"))]
README_MAX_CHARS = 10_000

# A config the docs name that another change adds; once it exists it is checked like the rest.
LANDS_SEPARATELY = {"configs/gsm8k_qwen2.5_0.5b_1gpu.yaml"}

# A config that loads only once an earlier command of its block has run.
NEEDS_THE_COMMAND_BEFORE = {
    "configs/reward_model.yaml": "its reward model is written by the command before it "
    "(tests/unit/test_reward_model_config.py loads it so)",
    "configs/distill.yaml": "its teacher is exported by the commands before it "
    "(tests/unit/test_distill.py loads it so)",
}

# Each heavy command (its text without PYTHONPATH=...) must match one pattern; the test cited
# runs that job or command already.
E2E = (
    "tests/integration/test_trainer_e2e.py",
    "test_async_run_learns_within_the_staleness_bound_with_an_elastic_generator",
)
WALK = ("tests/integration/test_readme_walkthrough.py", "test_the_readme_followed_in_a_fresh_copy")
HEAVY: list[tuple[str, tuple[str, str | None], str]] = [
    (r"bash scripts/demo\.sh$", WALK, "the README's demo command, run as written in a fresh copy"),
    (r"bash scripts/test\.sh$", (".ci/run", None), "CI runs exactly this command"),
    (
        r"asyncrl train configs/demo\.yaml .*control\.run_dir=runs/my-(reward|env) ",
        WALK,
        "the README's own reward and own environment runs, as written, in a fresh copy",
    ),
    (
        r"asyncrl train configs/demo\.yaml(?! .*(rollout\.model=|control\.run_dir=runs/my-))",
        E2E,
        "the demo config as a job",
    ),
    (
        r"asyncrl train --resume ",
        (
            "tests/faults/test_trainer_crash_resume.py",
            "test_sigkill_between_step_and_checkpoint_then_resume_trains_each_group_exactly_once_and_sigint_leaves_nothing",
        ),
        "asyncrl train --resume RUN_DIR after a crash (tests/support/job.py)",
    ),
    (r"asyncrl dashboard runs/\S+$", WALK, "the command over the finished demo's directory, read through its API"),
    (r"asyncrl export runs/demo( --step \d+)?$", E2E, "asyncrl export RUN_DIR of the finished run"),
    (
        r"asyncrl export runs/demo_lora( --adapter)?$",
        ("tests/unit/test_lora.py", "test_only_adapters_train_checkpoint_and_reference_is_the_base"),
        "merged and adapter-only exports of a LoRA checkpoint",
    ),
    (
        r"asyncrl train configs/demo_lora\.yaml$",
        ("tests/integration/test_lora_job.py", "test_a_lora_run_learns_with_adapter_only_publishes"),
        "the LoRA demo config as a job",
    ),
    (
        r"python examples/tiny_reward_model\.py \S+$",
        (
            "tests/unit/test_reward_model_config.py",
            "test_the_example_config_loads_once_its_tiny_reward_model_is_written",
        ),
        "writes the tiny reward model the example config names",
    ),
    (
        r"asyncrl train configs/reward_model\.yaml$",
        (
            "tests/integration/test_reward_model.py",
            "test_a_crashed_reward_model_is_restarted_and_its_pending_request_retried",
        ),
        "the config's load is tested with its model written; its reward-model actor runs in the integration "
        "test; the example job itself is not started by any test",
    ),
    (
        r"asyncrl export runs/distill-teacher --step \d+ --out \S+$",
        E2E,
        "asyncrl export RUN_DIR of a finished demo run, to a directory of its own",
    ),
    (
        r"asyncrl train configs/distill\.yaml$",
        ("tests/integration/test_teacher.py", "test_a_crashed_teacher_is_restarted_and_its_pending_request_retried"),
        "the config's load is tested with its teacher written; its teacher actor runs in the integration "
        "test; the example job itself is not started by any test (its numbers: docs/results.md)",
    ),
    (
        r"\.venv/bin/python bench/staleness\.py( --[a-z-]+)*$",
        ("tests/integration/test_bench_smoke.py", "test_staleness_smoke"),
        "the staleness bench's --smoke runs in the suite; --quick, the full grid and --report-only are "
        "the same code at other sizes",
    ),
    (
        r"asyncrl tiny-model \S+ --arch \S+$",
        ("tests/parity/test_model_matrix.py", "test_gemma2_job_trains_at_parity_resumes_and_exports"),
        "a tiny model of a family, trained as a job at lr 0",
    ),
    (
        r"asyncrl train configs/demo\.yaml rollout\.model=\S+ learner\.lr=0$",
        ("tests/parity/test_model_matrix.py", "test_gemma2_job_trains_at_parity_resumes_and_exports"),
        "the demo config on a tiny model of another family",
    ),
    (
        r"python -m asyncrl\.rollout\.tiny_vl \S+$",
        ("tests/integration/test_vision_job.py", "test_a_vision_language_run_trains_on_its_images_end_to_end"),
        "the tiny Idefics3 the vision job writes (write_tiny_idefics3, what the module's main calls)",
    ),
    (
        r"asyncrl train configs/demo\.yaml --check rollout\.model=\S+ "
        r"rollout\.env=asyncrl\.rollout\.envs\.colour:ColourEnv ",
        ("tests/integration/test_vision_job.py", "test_a_vision_language_run_trains_on_its_images_end_to_end"),
        "the colour task on the tiny Idefics3, run as a job with these settings; its --check image line is "
        "tests/unit/test_tiny_idefics3.py's",
    ),
]


@dataclass(frozen=True)
class Command:
    doc: str
    kind: str  # run | heavy | external
    env: dict[str, str]
    argv: list[str]

    @property
    def text(self) -> str:
        return " ".join(self.argv)

    def __str__(self) -> str:
        return f"{self.doc}: {self.text}"


FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)


def _blocks(path: Path) -> list[tuple[list[str], str]]:
    return [(m.group(1).split(), m.group(2)) for m in FENCE.finditer(path.read_text(encoding="utf-8"))]


def _commands(path: Path) -> list[Command]:
    out = []
    for info, body in _blocks(path):
        if not info or info[0] not in ("bash", "sh"):
            continue
        kind = "heavy" if "heavy" in info else "external" if "external" in info else "run"
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            env = {}
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if words and words[0] == "exec":
                words.pop(0)
            if words:
                out.append(Command(str(path.relative_to(ROOT)), kind, env, words))
    return out


ALL = [c for doc in DOCS for c in _commands(doc)]
ASYNCRL = [c for c in ALL if c.argv[0] == "asyncrl"]


@pytest.fixture
def docs_python_path(monkeypatch):
    """Set the Python path a command gives (PYTHONPATH=...), and nothing else of the repo's: the
    repo root is on pytest's path, so without this a command lacking PYTHONPATH=. would pass."""

    def use(command: Command) -> None:
        keep = [p for p in sys.path if p and Path(p).resolve() != ROOT]
        extra = [str((ROOT / p).resolve()) for p in command.env.get("PYTHONPATH", "").split(":") if p]
        monkeypatch.setattr(sys, "path", extra + keep)
        for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.chdir(ROOT)

    return use


def _train_config(command: Command) -> tuple[str | None, list[str]]:
    """The config file and overrides of an `asyncrl train` command (None with --resume)."""
    args, extra = _parser().parse_known_args(command.argv[1:])
    if args.resume:
        return None, []
    return args.config, [*args.overrides, *extra]


def test_the_docs_have_commands_of_every_kind():
    kinds = {c.kind for c in ALL}
    assert kinds == {"run", "heavy", "external"}, kinds
    assert sum(c.kind == "run" for c in ASYNCRL) >= 10


@pytest.mark.parametrize("command", ASYNCRL, ids=str)
def test_every_asyncrl_command_parses(command):
    """The subcommand and every option exist: what `asyncrl SUB --help` lists."""
    argv = command.argv[1:]
    if "--help" in argv or "-h" in argv:
        return  # run below (the runnable ones) or plain help
    try:
        args, extra = _parser().parse_known_args(argv)
    except SystemExit as e:
        pytest.fail(f"{command}: the argument parser refused it (exit {e.code})")
    if args.command == "dashboard":
        try:
            dashboard_parser().parse_args(extra)
        except SystemExit as e:
            pytest.fail(f"{command}: `asyncrl dashboard` refused its arguments (exit {e.code})")
    elif extra:
        assert args.command == "train" and all("=" in e and not e.startswith("-") for e in extra), (
            f"{command}: unrecognized arguments {extra}"
        )


TRAIN = [c for c in ASYNCRL if c.argv[1:2] == ["train"] and not {"--help", "--help-config"} & set(c.argv)]


@pytest.mark.parametrize("command", [c for c in TRAIN if c.kind != "external"], ids=str)
def test_every_train_command_loads_its_config_with_its_overrides(command, docs_python_path):
    config, overrides = _train_config(command)
    if config is None:
        return  # --resume: the run directory's own config
    if config in NEEDS_THE_COMMAND_BEFORE:
        pytest.skip(NEEDS_THE_COMMAND_BEFORE[config])
    docs_python_path(command)
    load_config(ROOT / config, overrides)  # a ConfigError names the field


@pytest.mark.parametrize("command", [c for c in TRAIN if c.kind == "external"], ids=str)
def test_external_train_commands_name_real_configs_and_fields(command):
    """Their values may be placeholders (a path on a GPU box), but the config file and every
    overridden field must exist."""
    config, overrides = _train_config(command)
    if config is not None and not (config in LANDS_SEPARATELY and not (ROOT / config).exists()):
        assert (ROOT / config).exists(), f"{command}: no config {config}"
    for override in overrides:
        model: type[BaseModel] | None = Config
        for part in override.partition("=")[0].split("."):
            if model is None:
                break  # a value inside a field (a dict, a loss's settings): the field itself exists
            assert part in model.model_fields, f"{command}: {override.partition('=')[0]} is not a config field"
            model = section_type(model.model_fields[part].annotation)


def _run_in_process(command: Command, capsys) -> tuple[int, str]:
    try:
        rc = main(command.argv[1:])
    except SystemExit as e:  # --help
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out + err


@pytest.mark.parametrize("command", [c for c in ALL if c.kind == "run"], ids=str)
def test_runnable_commands_run(command, capsys, monkeypatch, docs_python_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # CI has no network: a hub id is "not checked"
    docs_python_path(command)
    argv = command.argv
    if argv[0] == "python" and argv[1:] == ["scripts/config_reference.py", "--check"]:
        spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.main(["--check"]) == 0
        return
    # Classified before anything runs: a command that would start a job must never start here.
    assert _cheap(argv), (
        f"{command}: only --help, --help-config and `asyncrl train ... --check` run here; "
        f"mark its block `bash heavy` or `bash external`"
    )
    rc, out = _run_in_process(command, capsys)
    if "--help" in argv or "--help-config" in argv:
        assert rc == 0 and ("usage" in out.lower() or "asyncrl config" in out), f"{command}: {out[-2000:]}"
        return
    assert rc == 0, f"{command} exited {rc}: {out[-3000:]}"
    assert "check: " in out, out[-2000:]


def _cheap(argv: list[str]) -> bool:
    if argv[0] != "asyncrl":
        return False
    if "--help" in argv or "-h" in argv:
        return True
    return len(argv) > 1 and argv[1] == "train" and ("--help-config" in argv or argv[-1] == "--check")


@pytest.mark.parametrize("command", [c for c in ALL if c.kind == "heavy"], ids=str)
def test_heavy_commands_are_covered_by_a_test_that_runs_them(command):
    matches = [(where, why) for pattern, where, why in HEAVY if re.match(pattern, command.text)]
    assert matches, f"{command}: a heavy command no existing test is cited for (HEAVY in this file)"
    for (path, function), _why in matches:
        text = (ROOT / path).read_text(encoding="utf-8")
        assert function is None or f"def {function}(" in text, f"{path} has no test {function}"


def test_readme_is_a_landing_page_with_exactly_two_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text) <= README_MAX_CHARS, f"README.md has {len(text)} characters (at most {README_MAX_CHARS})"
    setup = [c.text for c in _commands(README) if c.argv[0] == "bash"]
    assert setup == ["bash scripts/demo.sh", "bash scripts/test.sh"], setup
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert (ROOT / script).exists()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_snippets_are_copied_from_their_files(doc):
    for info, body in _blocks(doc):
        source = next((word.removeprefix("file=") for word in info[1:] if word.startswith("file=")), None)
        if info[:1] == ["python"] and source is not None:
            assert body in (ROOT / source).read_text(encoding="utf-8"), f"{doc.name}: a snippet not in {source}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_and_headings_that_exist(doc):
    for target in LINK.findall(FENCE.sub("", doc.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        rel = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(file)
        if rel in LANDS_SEPARATELY and not file.exists():
            continue
        assert file.exists(), f"{doc.name}: link to {target}: no such file"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{doc.name}: link to {target}: no such heading"


def test_a_command_without_the_python_path_it_needs_fails_here(docs_python_path):
    """The check above is only worth something if a missing PYTHONPATH=. is caught."""
    override = "rollout.env=examples.custom_reward:EchoFirstEnv"
    without = Command("README.md", "run", {}, ["asyncrl", "train", "configs/demo.yaml", override])
    docs_python_path(without)
    with pytest.raises(ConfigError, match="cannot be found on the Python path"):
        load_config(ROOT / "configs" / "demo.yaml", [override, "rollout.env_kwargs={}"])
    docs_python_path(Command("README.md", "run", {"PYTHONPATH": "."}, without.argv))
    load_config(ROOT / "configs" / "demo.yaml", [override, "rollout.env_kwargs={}"])


def _docstring_commands(path: Path) -> list[Command]:
    """The `asyncrl train` commands an example's module docstring shows (the README sends
    readers to these files)."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    out = []
    for line in re.sub(r"\\+\n", " ", doc).splitlines():
        if "asyncrl train" not in line:
            continue
        words = shlex.split(line)
        env = {}
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words[:2] == ["asyncrl", "train"]:
            out.append(Command(str(path.relative_to(ROOT)), "run", env, words))
    return out


EXAMPLE_COMMANDS = [c for path in sorted((ROOT / "examples").rglob("*.py")) for c in _docstring_commands(path)]


@pytest.mark.parametrize("command", EXAMPLE_COMMANDS, ids=str)
def test_the_examples_own_train_commands_pass_check(command, capsys, monkeypatch, docs_python_path):
    """As `--check`: it builds the environment with its env_kwargs, which loading does not."""
    config, _ = _train_config(command)
    assert config is not None and (ROOT / config).exists(), f"{command}: no config {config}"
    if "gpu" in config:
        return  # the GPU box's config: its fields are checked with the external commands
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs_python_path(command)
    checked = Command(command.doc, "run", command.env, [*command.argv, "--check"])
    rc, out = _run_in_process(checked, capsys)
    assert rc == 0 and "check: " in out, f"{command} --check exited {rc}: {out[-3000:]}"


def test_the_examples_show_train_commands():
    assert {c.doc for c in EXAMPLE_COMMANDS} >= {"examples/custom_reward.py", "examples/multiturn_env.py"}


def test_every_subcommand_and_option_has_its_help_line():
    """`asyncrl SUB --help` opens with what SUB does, and describes every option it lists."""
    import argparse

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {name: p for name, p in sub.choices.items() if name != "dashboard"}
    parsers["dashboard"] = dashboard_parser()
    assert set(parsers) >= {"train", "generate", "dashboard", "export", "bench", "tiny-model"}
    for name, parser in parsers.items():
        assert parser.description, f"asyncrl {name} --help has no description"
        for action in parser._actions:
            assert action.help and action.help is not argparse.SUPPRESS, f"asyncrl {name}: {action.dest} has no help"
