"""Incremental detokenization with stop strings.

Each new token's text is the difference between decoding a short window of recent tokens with and
without it (vLLM's prefix/read offsets). Decoding windows, not single tokens, keeps SentencePiece
word-boundary spaces right (the window is primed with the prompt's last tokens, so the first output
token keeps its leading space); a run of byte-fallback tokens, and text ending in U+FFFD, are held back
until the run ends, so a character is never split. The deltas add up to decoding the whole sequence at
once.

Stop strings are searched around each new piece, so one spanning token boundaries is found. While a
request runs, the last (longest stop string - 1) characters are held back: they may turn out to be
the start of a stop string that must not be shown."""

from __future__ import annotations

import functools
import re

from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT = 6  # prompt tokens that prime the window: enough for word boundaries and byte pieces


def text_token_ids(token_ids: list[int], ended_by_stop_token: bool, include_stop_str_in_output: bool) -> list[int]:
    """The tokens whose text a request shows: the EOS or stop token that ended it is not text, unless the
    request asked for its stop in the output."""
    return token_ids[:-1] if ended_by_stop_token and not include_stop_str_in_output else token_ids


@functools.lru_cache(maxsize=16)
def _byte_fallback_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids of SentencePiece byte-fallback tokens (<0x41>). A run of them decodes as a group: when the
    group is not valid UTF-8, every byte of it becomes U+FFFD, even one that alone was valid ASCII."""
    pattern = re.compile(r"<0x[0-9A-Fa-f]{2}>")
    return frozenset(i for token, i in tokenizer.get_vocab().items() if pattern.fullmatch(token))


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        if not tokenizer.is_fast:
            raise ValueError("tokenizer: incremental detokenization needs a fast (tokenizers) tokenizer")
        self._decode = tokenizer.backend_tokenizer.decode
        self._byte_ids = _byte_fallback_ids(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._tokens = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._prefix_text = self._window(0, self._read_offset)
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        self._hold_back = 0 if include_stop_str_in_output else max((len(s) for s in self.stop), default=1) - 1
        self.output_text = ""
        self._num_sent = 0  # characters of output_text already returned by get_delta
        # After update() found a stop string: how many of its tokens the text needed, through the one that
        # completed the stop (speculative decoding delivers several per step; later ones are dropped).
        # None when the stop appeared only in the final flush, after every token.
        self.num_tokens_to_stop: int | None = None

    def _window(self, start: int, end: int) -> str:
        return self._decode(self._tokens[start:end], skip_special_tokens=self._skip_special_tokens)

    def update(self, new_token_ids: list[int], check_stop: bool = True, final: bool = False) -> str | None:
        """Append tokens' text; returns the stop string that ended the text, if any (the text is then
        truncated at it, keeping it when include_stop_str_in_output). `final` flushes a trailing
        incomplete character as U+FFFD, as a one-shot decode would."""
        if not (check_stop and self.stop):  # no stop string to place between tokens: one window for them all
            self._tokens.extend(new_token_ids)
            if new_token_ids or final:
                self.output_text += self._next_piece(final)
            return None
        pieces = [self._tokens.append(t) or self._next_piece(final=False) for t in new_token_ids]
        if final:
            pieces.append(self._next_piece(final=True))
        for i, piece in enumerate(pieces):
            if not piece:
                continue
            start = len(self.output_text)
            self.output_text += piece
            if check_stop and self.stop:
                hit = self._find_stop(start)
                if hit is not None:
                    self.num_tokens_to_stop = i + 1 if i < len(new_token_ids) else None
                    return hit
        return None

    def _next_piece(self, final: bool) -> str:
        if not final and self._tokens and self._tokens[-1] in self._byte_ids:
            return ""  # a byte run may go on: its text is only known once it ends
        text = self._window(self._prefix_offset, len(self._tokens))
        if len(text) <= len(self._prefix_text) or (text.endswith("\ufffd") and not final):
            return ""  # nothing new yet, or a character still waiting for its last bytes
        piece = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self._prefix_text = self._window(self._prefix_offset, self._read_offset)
        return piece

    def _find_stop(self, start: int) -> str | None:
        """The earliest stop string in the text, truncating the text at it."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            # A match may begin up to len(stop) - 1 characters before the new piece.
            index = self.output_text.find(stop, max(0, start - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[: index + len(stop) if self.include_stop_str_in_output else index]
        return stop

    @property
    def sent_text(self) -> str:
        return self.output_text[: self._num_sent]

    def get_delta(self, finished: bool) -> str:
        """Text not yet returned; while running, minus what may still become a stop string."""
        end = len(self.output_text) if finished else max(self._num_sent, len(self.output_text) - self._hold_back)
        delta = self.output_text[self._num_sent : end]
        self._num_sent = end
        return delta
