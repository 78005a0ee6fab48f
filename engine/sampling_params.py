"""SamplingParams: the one place where a request's sampling parameters are validated.

Checks that need the model (token ids inside the vocabulary, lengths against max_model_len) happen
when the engine accepts the request; everything else happens here, at construction."""

from __future__ import annotations

import enum
import json
from functools import cached_property
from typing import Any

import jsonschema
from pydantic import ConfigDict, Field, field_validator, model_validator

from engine.text_validation import ValidTextModel

_GREEDY_EPS = 1e-5  # temperatures below this sample greedily, as in vLLM
MAX_LOGPROBS = 20
# Largest schema, regex, grammar or choice list (UTF-8 bytes of its text): compile time and matcher
# memory grow with it, and a bigger one is more likely a mistake than a format.
MAX_GRAMMAR_BYTES = 64 * 1024


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output carries everything generated so far
    DELTA = "delta"  # every output carries only what is new since the previous one
    FINAL_ONLY = "final_only"  # one output, when the request finishes


def check_json_schema(schema: Any) -> None:
    """Raises ValueError when `schema` is not valid against its own meta-schema (for structured outputs
    and tool parameters alike)."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(map(str, e.absolute_path)) or "the root"
        raise ValueError(f"not a valid JSON schema at {where}: {e.message}") from None


class StructuredOutputsParams(ValidTextModel):
    """Constrain the output to a format (vLLM's names): exactly one of a JSON schema, any JSON object, a
    regular expression, one of a list of strings, an EBNF grammar (xgrammar's dialect, GBNF-like), or a
    structural tag (xgrammar's: free text in which a trigger starts a constrained region). JSON is
    generated compactly (", " and ": " separators, no free whitespace) unless disable_any_whitespace is
    False, so that a model cannot pad it forever. Checks needing the tokenizer (the compile itself) come
    later, when the engine or the serving ingress compiles it."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # `json` would shadow BaseModel.json: the field is `json_schema`, set as json=... like vLLM's.
    json_schema: dict[str, Any] | bool | str | None = Field(
        None, alias="json", description="A JSON schema (dict or its text).")
    json_object: bool | None = Field(None, description="True: any JSON object.")
    regex: str | None = Field(None, description="A regular expression the whole output matches.")
    choice: list[str] | None = Field(None, description="The output is exactly one of these strings.")
    grammar: str | None = Field(None, description="An EBNF grammar whose `root` rule the output matches.")
    structural_tag: str | None = Field(None, description="An xgrammar structural tag, as JSON text: "
                                       '{"type": "structural_tag", "format": ...} or '
                                       '{"structures": [...], "triggers": [...]}.')
    disable_any_whitespace: bool | None = Field(
        None, description="JSON whitespace: unset or True generates compact JSON; False allows any whitespace.")
    disable_additional_properties: bool = Field(
        False, description="JSON properties the schema does not name are never generated (always so here: strict).")
    disable_fallback: bool = Field(
        False, description="Accepted for vLLM: there is one backend, xgrammar, and no fallback.")
    whitespace_pattern: str | None = Field(None, description="Not supported by the xgrammar backend; rejected.")

    @model_validator(mode="after")
    def _check(self) -> StructuredOutputsParams:
        given = [k for k in _KINDS if self._value(k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(_KINDS)}; got {given or 'none'}")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs: whitespace_pattern is not supported by the xgrammar backend; "
                             "use disable_any_whitespace (compact JSON is the default)")
        kind, text = self.kind, self.text
        if len(text.encode()) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"structured_outputs: the {kind} is {len(text.encode())} bytes; at most "
                             f"{MAX_GRAMMAR_BYTES} are accepted")
        if kind == "json":
            schema = self.schema
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs: json must be a JSON schema: an object (or true/false)")
            try:
                check_json_schema(schema)
            except ValueError as e:
                raise ValueError(f"structured_outputs: json is {e}") from None
        elif kind == "choice" and not self.choice:
            raise ValueError("structured_outputs: choice must list at least one string")
        elif kind in ("regex", "grammar") and not text:
            raise ValueError(f"structured_outputs: {kind} must not be empty")
        elif kind == "structural_tag":
            try:
                tag = json.loads(text)
            except ValueError as e:
                raise ValueError(f"structured_outputs: structural_tag is not valid JSON: {e}") from None
            structures = tag.get("structures") if isinstance(tag, dict) else None
            legacy_ok = isinstance(structures, list) and isinstance(tag.get("triggers"), list) and all(
                isinstance(s, dict) and {"begin", "schema", "end"} <= s.keys() for s in structures)
            if not isinstance(tag, dict) or not ("format" in tag or legacy_ok):
                raise ValueError('structured_outputs: structural_tag must be an object with "format", or the older '
                                 '"structures" (each with begin, schema, end) and "triggers"')
        return self

    def _value(self, kind: str):
        return self.json_schema if kind == "json" else getattr(self, kind)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if self._value(k) not in (None, False))

    @property
    def any_whitespace(self) -> bool:
        """Whether generated JSON may hold free whitespace (only when disable_any_whitespace is False)."""
        return self.disable_any_whitespace is False

    @cached_property
    def schema(self) -> Any:
        """The JSON schema as an object (json only)."""
        if isinstance(self.json_schema, str):
            try:
                return json.loads(self.json_schema)
            except ValueError as e:
                raise ValueError(f"structured_outputs: json is not valid JSON: {e}") from None
        return self.json_schema

    @cached_property
    def text(self) -> str:
        """The format as text: what the compiler reads."""
        kind = self.kind
        if kind == "json":
            return self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
        if kind == "choice":
            return json.dumps(self.choice)
        return "" if kind == "json_object" else self._value(kind)

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        """Equal keys compile to the same grammar."""
        return self.kind, self.text, self.any_whitespace


_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class SamplingParams(ValidTextModel):
    """How to sample one request, with vLLM/OpenAI semantics. Invalid values raise a pydantic
    ValidationError (a ValueError) naming the parameter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(1, ge=1, description="Independent samples of the prompt; they share its KV blocks.")
    temperature: float = Field(1.0, ge=0.0, description="0 (or below 1e-5) means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(0, ge=-1, description="Keep the k most likely tokens; 0 or -1 keeps all.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x the top probability.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted once from tokens already generated.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted per occurrence in the output.")
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=10.0, description="Divides positive (multiplies negative) logits of prompt and output tokens."
    )
    logit_bias: dict[int, float] | None = Field(None, description="Token id -> bias in [-100, 100] added to its logit.")
    seed: int | None = Field(None, description="Per-request seed: same seed, same samples, whatever the batch.")
    max_tokens: int | None = Field(16, ge=1, description="Most tokens to generate; None runs to max_model_len.")
    min_tokens: int = Field(
        0, ge=0, description="EOS, stop tokens and stop strings are ignored before this many tokens.")
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token.")
    stop: list[str] = Field(default_factory=list, description="Strings that end the output (not included).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end the request.")
    include_stop_str_in_output: bool = Field(False, description="Keep the matched stop string in the text.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Return the sampled token's logprob and this many top ones."
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Return each prompt token's logprob and this many top ones."
    )
    detokenize: bool = Field(True, description="Produce text; False returns token ids only.")
    output_kind: RequestOutputKind = Field(RequestOutputKind.CUMULATIVE, description="What each output carries.")
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="Constrain the output to a JSON schema, regex, choice or grammar; ends it when complete."
    )
    thinking_token_budget: int | None = Field(
        None, ge=0, description="Most tokens a reasoning model thinks; then its end-of-thinking tag is forced.")
    thinking_start_token_ids: list[int] = Field(
        default_factory=list, description="The start-of-thinking tag's ids; empty: the output starts inside it.")
    thinking_end_token_ids: list[int] = Field(
        default_factory=list, description="The end-of-thinking tag's ids: a grammar applies only after them.")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value):
        return [value] if isinstance(value, str) else (value or [])

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: must be non-negative token ids")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if self.structured_outputs is not None and self.min_tokens:
            # Once the grammar is complete only EOS may follow, and min_tokens would ban it.
            raise ValueError("min_tokens: cannot be combined with structured_outputs; the format decides the length")
        budget = self.thinking_token_budget
        if (budget is not None or self.thinking_start_token_ids) and not self.thinking_end_token_ids:
            which = "thinking_token_budget" if budget is not None else "thinking_start_token_ids"
            raise ValueError(f"{which}: needs thinking_end_token_ids, the model's end-of-thinking tag (a serving "
                             "app's reasoning_parser supplies them)")
        if any(t < 0 for t in self.thinking_start_token_ids + self.thinking_end_token_ids):
            raise ValueError("thinking_end_token_ids: must be non-negative token ids")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: token {token} -> {bias}; ids must be >= 0 and biases in [-100, 100]")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    # Derived once per request (the model is frozen), read by the sampler for every token.
    @cached_property
    def sampling_row(self) -> tuple[float, float, float, float]:
        """(temperature, 0 for greedy; top_k, <= 0 for off; top_p; min_p)."""
        return (0.0 if self.greedy else self.temperature, float(self.top_k), self.top_p, self.min_p)

    @cached_property
    def needs_row_extras(self) -> bool:
        """Anything beyond sampling_row: a seed, logprobs, logit bias, min_tokens or penalties."""
        return (
            (self.seed is not None and not self.greedy) or self.logprobs is not None or bool(self.logit_bias)
            or self.min_tokens > 0 or self.has_penalties
        )

    def token_ids_to_check(self) -> set[int]:
        """Token ids the engine must find inside the vocabulary."""
        return (set(self.stop_token_ids) | set(self.logit_bias or ()) | set(self.thinking_start_token_ids)
                | set(self.thinking_end_token_ids))
