"""Tool use (rollout.env=tools): calls parsed from the reply, real tools run off the loop under a
timeout, their output (or error) sent back as tool messages that are context, never trained,
and the context the engine gets at each turn is the templated conversation.

.venv/bin/python -m pytest tests/unit/test_tool_env.py -q

Only the model's text is scripted (the policy a generator's engine would be); the tokenizer is a
real one written by the test (tests/support/tools.py, a Qwen-like tool template) and the tools
are real functions.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import numpy as np
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.control.allowlist import named_imports, typed_imports
from asyncrl.control.preflight import check_imports
from asyncrl.control.step_metrics import episode_counts
from asyncrl.rollout.envs import make_env
from asyncrl.rollout.envs.calculator import calculator
from asyncrl.rollout.envs.chat import ChatTemplateError, check_turn_template
from asyncrl.rollout.envs.multiturn import EPISODE_COUNTS_KEY, run_trajectory, to_interleaved_sample
from asyncrl.rollout.envs.tool_calls import BadCall, ParsedReply, ToolCall, get_parser, parse_hermes, register_parser
from asyncrl.types import RolloutGroup
from tests.support.chat import CHATML, scripted_policy
from tests.support.tools import tool_tokenizer

CALC = "asyncrl.rollout.envs.calculator:calculator"
CAPITAL = "tests.support.tools:capital"
STATS = "tests.support.tools:stats"
NAP = "tests.support.tools:nap"
SLOW = "tests.support.tools:slow_lookup"
REWARD = "tests.support.tools:final_number"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tool_tokenizer(tmp_path_factory.mktemp("tooltok"))


def tool_env(tools=(CALC, CAPITAL), **kwargs):
    return make_env("tools", {"tools": list(tools), "reward": REWARD, **kwargs})


def call(name, **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def scripted(tok, replies):
    """The model's side: fixed (text, finish_reason) replies; records each context it was given."""
    return scripted_policy(tok, replies, logprob=-0.5, version=3)


def episode(tok, env, prompt, meta, replies, budget=4096):
    policy, contexts = scripted(tok, replies)
    codec = env.turn_codec(tok, chat_template=True)
    traj = asyncio.run(run_trajectory(env, prompt, meta, policy, codec, budget))
    return traj, contexts


def rendered(tok, messages, tools):
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def tool_messages(tok, traj, k):
    """The tool results in observation k, as the model reads them."""
    return tok.decode(traj.observation_ids[k])


# ----------------------------------------------------------------------------- parsing


def test_hermes_reads_well_formed_calls_in_order():
    text = (
        'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
        '<tool_call>{"name": "capital", "arguments": "{\\"country\\": \\"peru\\"}"}</tool_call>'
        '<tool_call>{"name": "noargs"}</tool_call> done'
    )
    reply = parse_hermes(text)
    assert reply.content == "Let me compute.  done"
    assert reply.calls == (
        ToolCall("calculator", {"expression": "6*7"}),
        ToolCall("capital", {"country": "peru"}),  # arguments written as a JSON string
        ToolCall("noargs", {}),
    )
    assert parse_hermes("The answer is 42.") == ParsedReply("The answer is 42.", ())


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("<tool_call>{'name': 'calculator'}</tool_call>", "not valid JSON"),
        ('<tool_call>["calculator"]</tool_call>', "JSON list, expected an object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
        ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', "arguments of 'c' are a JSON list"),
        ('<tool_call>{"name": "c", "arguments": "x"}</tool_call>', "string that is not a JSON object"),
        ('<tool_call>{"name": "calculator", "argu', "never closed"),
    ],
)
def test_hermes_turns_malformed_calls_into_bad_calls(body, why):
    (bad,) = parse_hermes("ok " + body).calls
    assert isinstance(bad, BadCall) and why in bad.error


def test_parsers_are_a_registry_and_import_paths():
    with pytest.raises(ValueError, match=r"'xml': not a registered format \(hermes\)"):
        get_parser("xml")
    register_parser("upper", lambda text: ParsedReply(text.upper()))
    assert get_parser("upper")("a").content == "A"
    assert get_parser("asyncrl.rollout.envs.tool_calls:parse_hermes") is parse_hermes
    with pytest.raises(ValueError, match="has no function 'nope'"):
        get_parser("asyncrl.rollout.envs.tool_calls:nope")


def test_calculator_does_arithmetic_and_nothing_else():
    assert calculator("(12 + 30) * 2") == "84"
    assert calculator("7 / 2") == "3.5" and calculator("2**10") == "1024" and calculator("-3 % 5") == "2"
    for bad, why in [("__import__('os')", "not arithmetic"), ("9**9**9", "exponent"), ("1 +", "cannot read")]:
        with pytest.raises(ValueError, match=why):
            calculator(bad)


# ----------------------------------------------------------------------------- episodes


def test_an_episode_gives_the_engine_the_templated_conversation_and_trains_only_sampled_tokens(tok):
    env = tool_env()
    schemas = env.chat_tools()
    assert [s["function"]["name"] for s in schemas] == ["calculator", "capital"]
    assert schemas[1]["function"]["parameters"]["properties"]["country"]["type"] == "string"
    first = "Let me check." + call("calculator", expression="6*7") + call("capital", country="France")
    final = "6*7 = 42 and it is Paris. Answer: 42"
    traj, contexts = episode(tok, env, "what is 6*7?", {"answer": 42}, [(first + "<eos>", "stop"), (final, "stop")])

    # Tool results of one reply come back together, in order, as the template groups them (after
    # the rest of the end of turn: the engine stopped on its <eos>).
    assert tool_messages(tok, traj, 0) == (
        "|<bos>user:<tool_response>42</tool_response><tool_response>Paris</tool_response><eos>|<bos>assistant:"
    )
    assert traj.rewards == [0.0, 1.0] and traj.counts == {"tool_calls": 2, "tool_errors": 0, "tool_timeouts": 0}

    # Parity: every context is apply_chat_template of the conversation so far, tools included.
    conversation = [{"role": "user", "content": "what is 6*7?"}]
    assert contexts[0] == rendered(tok, conversation, schemas) == traj.prompt_ids
    conversation += [
        {"role": "assistant", "content": first},
        {"role": "tool", "name": "calculator", "content": "42"},
        {"role": "tool", "name": "capital", "content": "Paris"},
    ]
    assert contexts[1] == rendered(tok, conversation, schemas)

    # The learner's sample: prompt + response is the last context plus the last reply; loss mask
    # 1 exactly on the ids the engine sampled, 0 on the tool output and template tokens.
    flat = to_interleaved_sample(traj)
    assert flat.prompt_ids.tolist() + flat.response_ids.tolist() == contexts[1] + traj.turns[1].token_ids
    n1, n_obs, n2 = len(traj.turns[0].token_ids), len(traj.observation_ids[0]), len(traj.turns[1].token_ids)
    assert flat.loss_mask.tolist() == [1] * n1 + [0] * n_obs + [1] * n2
    assert flat.rollout_logprobs.tolist() == [-0.5] * n1 + [0.0] * n_obs + [-0.5] * n2
    assert tok.decode(flat.response_ids[flat.loss_mask == 0]) == tool_messages(tok, traj, 0)


def test_tool_errors_are_told_to_the_model_and_the_episode_goes_on(tok):
    env = tool_env((CALC, CAPITAL, STATS))
    calls = [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+"</tool_call>',  # bad JSON
        call("weather", city="Lima"),  # unknown tool
        call("capital"),  # missing argument
        call("stats", values=[1, "2"]),  # not checked inside arrays: the tool raises
        call("stats", values=[1, 2], scale="3"),  # wrong type
        call("capital", country="Atlantis"),  # the tool raises
        call("calculator", expression="2**100"),  # fine
        call("stats", values=[1, 5], colour=1),  # unknown argument
    ]
    traj, _ = episode(tok, env, "go", {"answer": 1}, [("".join(calls), "stop"), ("1", "stop")])
    told = tool_messages(tok, traj, 0)
    for expected in [
        "error: the call is not valid JSON",
        "error: unknown tool 'weather'; the tools are calculator, capital, stats",
        "error: bad arguments for capital: missing argument(s) country",
        "error: stats raised TypeError",
        "error: bad arguments for stats: argument 'scale' is \"3\", expected integer",
        "error: capital raised KeyError: 'atlantis'",
        "1267650600228229401496703205376",
        "error: bad arguments for stats: unknown argument(s) colour; stats takes values, scale",
    ]:
        assert expected in told, (expected, told)
    assert traj.counts == {"tool_calls": 8, "tool_errors": 7, "tool_timeouts": 0}
    assert traj.rewards == [0.0, 1.0]  # the episode went on to its answer


def test_a_tool_past_its_timeout_is_reported_and_the_episode_goes_on(tok):
    env = tool_env((NAP, SLOW, CALC), tool_timeout_s=0.3)
    reply = call("nap", seconds=30) + call("slow_lookup", seconds=30) + call("calculator", expression="2+2")
    t0 = time.monotonic()
    traj, contexts = episode(tok, env, "go", {"answer": 4}, [(reply, "stop"), ("4", "stop")])
    elapsed = time.monotonic() - t0
    told = tool_messages(tok, traj, 0)
    assert "error: nap did not return within 0.3 s" in told and "error: slow_lookup did not return within 0.3 s" in told
    assert "<tool_response>4</tool_response>" in told
    assert traj.counts == {"tool_calls": 3, "tool_errors": 0, "tool_timeouts": 2}
    assert len(contexts) == 2 and traj.rewards == [0.0, 1.0]
    assert elapsed < 10  # both waited at once, and neither was waited out


def test_the_turn_limit_ends_the_episode_without_running_the_last_calls(tok):
    env = tool_env(max_turns=2)
    again = call("calculator", expression="1+1")
    traj, contexts = episode(tok, env, "go", {"answer": 2}, [(again, "stop"), (again, "stop"), ("2", "stop")])
    assert len(traj.turns) == len(contexts) == 2
    assert traj.counts["tool_calls"] == 1  # the second reply's call was not run
    assert traj.observation_ids[-1] == [] and traj.rewards == [0.0, 0.0]


def test_a_failing_reward_voids_the_episode_reward_not_the_generator(tok):
    env = make_env("tools", {"tools": [CALC], "reward": "tests.support.tools:broken_reward"})
    traj, _ = episode(tok, env, "go", {}, [("42", "stop")])
    assert math.isnan(traj.total_reward)  # the learner leaves it out of the loss


def test_a_template_that_ignores_tools_is_refused(tmp_path):
    plain = tool_tokenizer(tmp_path, CHATML)
    with pytest.raises(ChatTemplateError, match="ignores tools"):
        tool_env().turn_codec(plain, chat_template=True)
    with pytest.raises(ChatTemplateError, match=r"needs rollout\.chat_template=true"):
        tool_env().turn_codec(plain, chat_template=False)
    with pytest.raises(ChatTemplateError, match=r"rollout.env='tools'"):
        check_turn_template(plain, "tools", {"tools": [CALC], "reward": REWARD})


# ----------------------------------------------------------------------------- config, --check, metrics


TOOLS_YAML = {
    "rollout": {
        "chat_template": True,
        "env": {"type": "tools", "tools": [CALC, CAPITAL], "reward": REWARD, "max_turns": 3},
    }
}


def test_config_folds_the_env_mapping_and_checks_it():
    from asyncrl.config import config_from_dict

    cfg = config_from_dict(TOOLS_YAML)
    assert cfg.rollout.env == "tools" and cfg.rollout.env_kwargs["max_turns"] == 3
    with pytest.raises(ConfigError, match=r"rollout\.env=tools needs rollout\.chat_template=true"):
        load_config(None, ["rollout.env=tools", f"rollout.env_kwargs={{tools: [{CALC}], reward: {REWARD}}}"])
    bad = [
        ({"tools": [], "reward": REWARD}, "rollout.env_kwargs.tools"),
        ({"tools": [CALC], "reward": REWARD, "tool_timeout": 3}, "rollout.env_kwargs.tool_timeout"),
        ({"tools": ["nowhere.at_all:fn"], "reward": REWARD}, r"rollout.env_kwargs.tools\[0\].*cannot be found"),
        ({"tools": [CALC]}, "rollout.env_kwargs.reward"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ConfigError, match=match):
            config_from_dict({"rollout": {"chat_template": True, "env": {"type": "tools", **kwargs}}})


def test_check_imports_the_tools_and_the_allowlist_names_them():
    from asyncrl.config import config_from_dict

    cfg = config_from_dict({**TOOLS_YAML, "rollout": {**TOOLS_YAML["rollout"], "prompts": "configs/demo.yaml"}})
    lines = check_imports(cfg)
    assert f"rollout.env_kwargs.tools: {CAPITAL}: imported, capital(country)" in lines
    expected = {("rollout.env_kwargs.tools[0]", CALC), ("rollout.env_kwargs.tools[1]", CAPITAL)}
    expected.add(("rollout.env_kwargs.reward", REWARD))
    for found in (named_imports(TOOLS_YAML), typed_imports(cfg)):
        assert {(i.field, i.path) for i in found} >= expected

    undocumented = {"type": "tools", "tools": ["tests.support.tools:final_number"], "reward": REWARD}
    cfg = config_from_dict({"rollout": {"chat_template": True, "prompts": "configs/demo.yaml", "env": undocumented}})
    with pytest.raises(ConfigError, match=re.escape("tool 'tests.support.tools:final_number': cannot make its schema")):
        check_imports(cfg)


def test_tool_counts_become_step_metrics():
    def group(counts):
        return RolloutGroup("g", "p", np.zeros(1, np.int32), [], metadata={EPISODE_COUNTS_KEY: counts})

    groups = [group({"tool_calls": 3, "tool_errors": 1, "tool_timeouts": 0}), group({"tool_calls": 2, "other": 9})]
    expected = {"rollout/tool_calls": 5.0, "rollout/tool_errors": 1.0, "rollout/tool_timeouts": 0.0}
    assert episode_counts(groups) == expected  # "other" is not a catalogued metric


def test_the_example_config_checks_and_its_reward_reads_the_final_answer(monkeypatch):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    cfg = load_config("configs/tools_calculator_qwen2.5_0.5b_gpu.yaml")
    assert "rollout.env_kwargs.tools: asyncrl.rollout.envs.calculator:calculator: imported, calculator(expression)" in (
        check_imports(cfg)
    )
    from examples.tools.calc import final_answer

    row = json.loads((root / "examples/tools/calc_prompts.jsonl").read_text().splitlines()[0])
    expr = row["prompt"].removeprefix("What is ").partition("?")[0]
    assert calculator(expr) == row["answer"]  # the calculator solves the task
    assert final_answer([row["prompt"]], [f"It is {int(row['answer']):,}."], [row["answer"]]) == [1.0]
    assert final_answer([row["prompt"]], ["It is 7."], [row["answer"]]) == [0.1]
    assert final_answer([row["prompt"]], ["no idea"], [row["answer"]]) == [0.0]


def test_null_is_a_valid_argument_for_an_optional_parameter_only(tok):
    """The schema shows ``digits: int | None`` as nullable: null must not be answered as a bad call."""
    env = tool_env(("tests.support.tools:rounded",))
    assert env.chat_tools()[0]["function"]["parameters"]["properties"]["digits"]["nullable"] is True
    calls = [
        call("rounded", value=2.71828, digits=None),  # nullable: runs
        call("rounded", value=2.71828, digits=2),
        call("rounded", value=None, digits=1),  # value is not nullable
        call("rounded", value=2.5, digits="1"),  # still type-checked when not null
    ]
    traj, _ = episode(tok, env, "go", {"answer": 3}, [("".join(calls), "stop"), ("3", "stop")])
    told = tool_messages(tok, traj, 0)
    assert "<tool_response>3</tool_response><tool_response>2.72</tool_response>" in told, told
    assert "error: bad arguments for rounded: argument 'value' is null, expected number" in told
    assert "error: bad arguments for rounded: argument 'digits' is \"1\", expected integer" in told
    assert traj.counts == {"tool_calls": 4, "tool_errors": 2, "tool_timeouts": 0}
