"""Tool answers as the token ids appended to a trajectory, with the chat template's own glue.

The conversation is never re-rendered: the policy's sampled ids stay as drawn, and what follows a turn is the
*fixed-base delta* of the template::

    BASE  = [user "u", assistant "a"]                   rendered, cut after its last stop token
    delta = render(BASE + tool messages, add_generation_prompt=True)[len(BASE's ids):]

so the delta carries whatever the template puts after an assistant's end token (a newline), the tool messages in the
template's own form, and the next assistant header; all of it is masked 0 in training. All tool messages of a turn go
into one delta (templates that merge consecutive tool messages stay right). A template whose render of BASE is not a
prefix of the longer render cannot be used this way: that is an error at start, naming the template.
"""

from __future__ import annotations

from typing import Any

TRUNCATE_SIDES = ("left", "middle", "right")
BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def truncate(text: str, limit: int, side: str) -> str:
    """``text`` cut to ``limit`` characters: ``left`` drops the head (keeps the tail), ``right`` drops the tail,
    ``middle`` keeps both ends; the cut is marked ``...``."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "..." + text[len(text) - limit :]
    if side == "right":
        return text[:limit] + "..."
    head = (limit + 1) // 2
    return text[:head] + "..." + text[len(text) - (limit - head) :]


class ObservationEncoder:
    """Token ids of tool answers for a tokenizer with a chat template (see the module doc)."""

    def __init__(self, tokenizer: Any, stop_token_ids: list[int], max_chars: int, max_tokens: int, side: str):
        self.tokenizer = tokenizer
        self.max_chars, self.max_tokens, self.side = int(max_chars), int(max_tokens), side
        rendered = self._render(BASE, add_generation_prompt=False)
        ends = [index for index, token in enumerate(rendered) if token in set(stop_token_ids)]
        if not ends:
            raise ValueError("the tokenizer's chat template ends an assistant message with no stop token")
        self.base_ids = rendered[: ends[-1] + 1]

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def cap(self, text: str) -> tuple[str, bool]:
        """A tool answer cut to ``max_tool_response_length`` characters, then ``max_tool_response_tokens`` tokens;
        whether it was cut."""
        capped = truncate(text, self.max_chars, self.side)
        ids = self.tokenizer(capped, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_tokens:
            head = {"left": 0, "right": self.max_tokens, "middle": (self.max_tokens + 1) // 2}[self.side]
            tail = self.max_tokens - head
            kept_head = self.tokenizer.decode(ids[:head]) if head else ""
            kept_tail = self.tokenizer.decode(ids[len(ids) - tail :]) if tail else ""
            capped = f"{kept_head}...{kept_tail}"
        return capped, capped != text

    def encode(self, answers: list[str], role: str = "tool") -> list[int]:
        """The ids that follow an assistant turn's stop token when the tools answered ``answers`` (``role="user"``:
        when a simulated user did)."""
        return self.encode_messages([{"role": role, "content": answer} for answer in answers])

    def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids that follow an assistant turn's stop token when ``messages`` (any roles) come next, up to the next
        assistant header."""
        rendered = self._render(BASE + list(messages), add_generation_prompt=True)
        if rendered[: len(self.base_ids)] != self.base_ids:
            raise ValueError(
                "the tokenizer's chat template renders the conversation differently once tool messages follow, so "
                "tool answers cannot be appended as tokens; use a template whose renders are prefixes of each other"
            )
        return rendered[len(self.base_ids) :]
