"""Where a reasoning model's output stands in its thinking block, and the thinking budget.

A sample whose SamplingParams carry thinking_end_token_ids follows its output token by token: opening (the
output may start with the start tag), thinking, then the answer. When it has thought thinking_token_budget
tokens, the sampler forces the end tag, one token per step, so the answer follows; a structured-output grammar
(a response format, a forced tool call) constrains the answer only, never the thinking. Tags are matched as
token ids: exact for models whose tags are single special tokens (Qwen3's and DeepSeek-R1's <think>, gpt-oss's
Harmony headers); a tag the model spells in other tokens goes unseen, and the budget then ends the thinking.

Without start ids the output starts inside the thinking (the prompt opened it: DeepSeek-R1's template); with
them, an output that does not begin with them has no thinking (Qwen3 with thinking off)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.sampling_params import SamplingParams


class Phase(enum.IntEnum):
    OPENING = 0  # the output may yet begin with the start tag
    THINKING = 1
    ANSWER = 2


@dataclass
class ThinkingState:
    start: tuple[int, ...]
    end: tuple[int, ...]
    budget: int | None  # None: unbounded
    # A grammar follows the thinking: once the output has begun the start tag it must complete it, since the
    # tokens before a grammar starts are not the grammar's.
    complete_start: bool = False
    phase: Phase = Phase.OPENING
    num_seen: int = 0  # output tokens consumed
    matched: int = 0  # OPENING: tokens of the start tag so far; THINKING: of the end tag the output ends with
    num_thought: int = 0  # tokens after the start tag, the end tag included
    answer_start: int = 0  # ANSWER: the output index where the answer begins

    @classmethod
    def of(cls, params: SamplingParams) -> ThinkingState | None:
        if not params.thinking_end_token_ids:
            return None
        start = tuple(params.thinking_start_token_ids)
        return cls(start, tuple(params.thinking_end_token_ids), params.thinking_token_budget,
                   complete_start=params.structured_outputs is not None,
                   phase=Phase.OPENING if start else Phase.THINKING)

    @property
    def in_answer(self) -> bool:
        return self.phase is Phase.ANSWER

    def advance(self, output_token_ids: list[int]) -> None:
        """Consume the output tokens not yet seen."""
        for i in range(self.num_seen, len(output_token_ids)):
            token = output_token_ids[i]
            if self.phase is Phase.OPENING:
                if token == self.start[self.matched]:
                    self.matched += 1
                    if self.matched == len(self.start):
                        self.phase, self.matched = Phase.THINKING, 0
                else:
                    self.phase, self.answer_start = Phase.ANSWER, 0  # all of it is answer, the partial tag too
            elif self.phase is Phase.THINKING:
                self.num_thought += 1
                self.matched = self.matched + 1 if token == self.end[self.matched] else int(token == self.end[0])
                if self.matched == len(self.end):
                    self.phase, self.answer_start = Phase.ANSWER, i + 1
        self.num_seen = len(output_token_ids)

    def forced_token(self) -> int | None:
        """The token the next step must sample: the rest of a begun start tag (with a grammar to follow), or
        the rest of the end tag once the budget is spent."""
        if self.phase is Phase.OPENING:
            return self.start[self.matched] if self.matched and self.complete_start else None
        if self.phase is Phase.THINKING and self.budget is not None and self.num_thought - self.matched >= self.budget:
            return self.end[self.matched]
        return None

    @property
    def opening_token(self) -> int | None:
        """The start tag's first token while the output may still open with it: allowed beside a grammar's
        first tokens."""
        return self.start[0] if self.phase is Phase.OPENING and not self.matched else None
