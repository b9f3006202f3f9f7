"""How a multi-turn episode's text becomes the token ids the engine samples from.

    codec = turn_codec(tokenizer, chat_template=True, role="user")
    context = codec.prompt("5>")                        # the first prompt, as single-turn prompts
    context += reply_ids                                # the engine's tokens, never re-tokenized
    context += codec.observation(";4>", reply_ids, "stop")   # the env's answer as a chat turn

The engine's replies are appended as the ids it sampled (token in, token out): decoding and
re-encoding a reply can give other ids, and the learner would then score tokens the engine
never sampled. Only the environment's text is tokenized, and the same ids go to the engine
and, through the sample, to the learner.

Without a chat template an observation is its text's ids with no special tokens (a
Llama-style tokenizer would put a BOS in the middle of the context). With one, it is a chat
turn: the ids the template adds for that message, found with a fixed base conversation
(SkyRL's multi-turn tokenization; the "fixed-base approach"):

    ids(render(base + [message], add_generation_prompt=True)) - ids(render(base))

that is, the message's own header and end plus the next assistant header. What the template
writes after an assistant message's content that the engine does not sample (ChatML's
"<|im_end|>\\n": the engine stops at <|im_end|>, the "\\n" is never sampled) is put in front
of the observation, so the context stays the templated conversation. A template for which
these differences are not prefixes (it renders earlier turns differently once a later turn
exists, or its generation prompt is not how it renders an assistant message) cannot be
extended turn by turn: ``ChatTemplateError`` says so when the codec is built.
"""

from __future__ import annotations

from typing import Any, Protocol

from asyncrl.rollout.envs.base import make_env, resolve_env_class
from asyncrl.rollout.prompts import PromptSourceError, encode_prompt

_BASE_USER = "hi"
_BASE_REPLY = "ok"
_PROBE = "0"


Message = dict[str, Any]
Observation = str | list[Message]
"""What an environment answers a turn with: text (a turn of its observation role), or chat
messages rendered as the template writes them (several tool results at once, say)."""


class ChatTemplateError(PromptSourceError):
    """The tokenizer's chat template cannot be extended one turn at a time."""


class TurnCodec(Protocol):
    """Text of an episode -> ids of the engine's context (see the module doc)."""

    def prompt(self, text: str) -> list[int]: ...

    def observation(self, text: Observation, reply_ids: list[int], finish_reason: str) -> list[int]: ...

    def reply_text(self, reply_ids: list[int]) -> str: ...


class PlainTurns:
    """No chat template: the prompt as single-turn prompts are encoded, observations as bare text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def prompt(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text, chat_template=False)

    def observation(self, text: Observation, reply_ids: list[int], finish_reason: str) -> list[int]:
        if not isinstance(text, str):
            raise ChatTemplateError("an environment that answers with chat messages needs rollout.chat_template=true")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def reply_text(self, reply_ids: list[int]) -> str:
        return self.tokenizer.decode(reply_ids, skip_special_tokens=True)


class ChatTurns(PlainTurns):
    """rollout.chat_template: the prompt as one user turn, each observation as a turn of ``role``."""

    def __init__(self, tokenizer, role: str = "user"):
        super().__init__(tokenizer)
        self.role = role
        base = [{"role": "user", "content": _BASE_USER}, {"role": "assistant", "content": _BASE_REPLY}]
        self._base = base
        opened = self._render(base[:1], generation_prompt=True)
        closed = self._render(base, generation_prompt=False)
        if not closed.startswith(opened + _BASE_REPLY):
            raise ChatTemplateError(
                f"the chat template does not render an assistant message as its generation prompt followed "
                f"by the content: after {opened!r} it renders {closed[len(opened) :]!r} for the reply "
                f"{_BASE_REPLY!r}, so the replies the engine samples cannot be kept token for token"
            )
        self._base_ids = self._ids(closed)
        upto = self._ids(closed[: len(opened) + len(_BASE_REPLY)])
        if self._base_ids[: len(upto)] != upto:
            raise ChatTemplateError("the chat template's end of an assistant turn merges with its content on encoding")
        self.turn_end = self._base_ids[len(upto) :]
        """What the template writes after an assistant message's content (e.g. <|im_end|>, "\\n")."""
        self._delta([self.message(_PROBE)])  # a template that cannot be extended fails here, before any rollout

    def prompt(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text, chat_template=True)

    def observation(self, text: Observation, reply_ids: list[int], finish_reason: str) -> list[int]:
        messages = [self.message(text)] if isinstance(text, str) else list(text)
        return self.closing(reply_ids, finish_reason) + self._delta(messages)

    def message(self, text: str) -> Message:
        return {"role": self.role, "content": text}

    def closing(self, reply_ids: list[int], finish_reason: str) -> list[int]:
        """The rest of the template's end of the assistant turn: all of it unless the engine
        stopped on its first token (a reply cut at max_tokens gets the whole end, so the next
        turn does not run on inside the unfinished one)."""
        end = self.turn_end
        if end and finish_reason == "stop" and reply_ids and reply_ids[-1] == end[0]:
            return end[1:]
        return list(end)

    def _delta(self, messages: list[Message]) -> list[int]:
        # Rendered together: a template may write consecutive messages as one turn (Qwen's
        # groups a reply's tool results into one user turn), so each alone would differ.
        extended = self._ids(self._render([*self._base, *messages], generation_prompt=True))
        if extended[: len(self._base_ids)] != self._base_ids:
            roles = [m.get("role") for m in messages]
            raise ChatTemplateError(
                f"the chat template is not prefix-stable: a conversation with more turns ({roles}) "
                f"does not begin with the ids of the conversation without it, so the context cannot grow "
                f"one turn at a time (use rollout.chat_template=false and format the turns in the environment)"
            )
        return extended[len(self._base_ids) :]

    def _render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        except Exception as e:  # the template's own error (e.g. a role it does not accept)
            roles = [m["role"] for m in messages]
            raise ChatTemplateError(f"the chat template cannot render the roles {roles}: {e}") from e

    def _ids(self, rendered: str) -> list[int]:
        # The rendered text carries the template's special tokens: none are added again.
        return self.tokenizer.encode(rendered, add_special_tokens=False)


def turn_codec(tokenizer, *, chat_template: bool, role: str = "user") -> TurnCodec:
    """The codec for rollout.chat_template; observations become turns of ``role`` (the env's)."""
    return ChatTurns(tokenizer, role) if chat_template else PlainTurns(tokenizer)


def check_turn_template(tokenizer, env_name: str, env_kwargs: dict[str, Any] | None = None) -> None:
    """At start-up, for rollout.chat_template: a multi-turn environment needs a template that
    grows one turn at a time (otherwise every generator would fail at its start). The
    environment builds its own codec (a tool environment renders its tool schemas too)."""
    cls = resolve_env_class(env_name)
    if not cls.multi_turn:
        return
    env: Any = make_env(env_name, env_kwargs)  # multi_turn: a MultiTurnEnvironment (not imported here: it imports us)
    try:
        env.turn_codec(tokenizer, chat_template=True)
    except ChatTemplateError as e:
        where = f"rollout.chat_template=true with the multi-turn rollout.env={env_name!r}"
        raise ChatTemplateError(f"{where}: {e}") from None
