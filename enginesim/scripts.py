"""Scripted outputs: "after this prompt, emit exactly these ids".

A script is a function of the context like the hash model, so replay keeps working: the
next token is ``output_token_ids[j]`` whenever the context is ``prompt + outputs[:j]``
(``exact``) or ends with it (``suffix``). Once the script is exhausted the hash model takes
over; end a script with the eos id to make it stop there.

Precedence: exact before suffix, then the longest matched key, then the newest script.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class MatchMode(enum.Enum):
    # The whole context must be the script's prompt plus a prefix of its outputs.
    EXACT = "exact"
    # The context must end with the script's prompt plus a prefix of its outputs; lets a
    # test script a chat turn without knowing the template's leading tokens.
    SUFFIX = "suffix"


@dataclass(frozen=True, slots=True)
class Script:
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    match: MatchMode = MatchMode.EXACT


@dataclass(frozen=True, slots=True)
class _Key:
    tokens: tuple[int, ...]  # prompt + outputs[:j]
    next_token: int  # outputs[j]
    exact: bool
    order: int  # registration order; newer wins ties


class ScriptBook:
    """An immutable set of scripts with a per-step lookup indexed by the last token."""

    def __init__(self, scripts: Sequence[Script] = ()) -> None:
        self.scripts: tuple[Script, ...] = tuple(scripts)
        # Candidates keyed by the last token of their key, so a step only compares the
        # few keys that could possibly match instead of every prefix of every script.
        self._by_last: dict[int, list[_Key]] = {}
        for order, script in enumerate(self.scripts):
            full = script.prompt_token_ids + script.output_token_ids
            for j, token in enumerate(script.output_token_ids):
                key = _Key(
                    full[: len(script.prompt_token_ids) + j],
                    token,
                    script.match is MatchMode.EXACT,
                    order,
                )
                self._by_last.setdefault(key.tokens[-1], []).append(key)
        for keys in self._by_last.values():
            keys.sort(key=lambda k: (not k.exact, -len(k.tokens), -k.order))

    def __bool__(self) -> bool:
        return bool(self.scripts)

    def with_script(self, script: Script) -> ScriptBook:
        """A new book with ``script`` added; replaces one with the same prompt and mode."""
        kept = [
            s
            for s in self.scripts
            if (s.prompt_token_ids, s.match) != (script.prompt_token_ids, script.match)
        ]
        return ScriptBook([*kept, script])

    def next_token(self, context: Sequence[int]) -> int | None:
        """The scripted next token after ``context``, or None to use the hash model."""
        if not context:
            return None
        for key in self._by_last.get(context[-1], ()):
            n = len(key.tokens)
            if key.exact and len(context) != n:
                continue
            if len(context) >= n and tuple(context[-n:]) == key.tokens:
                return key.next_token
        return None
