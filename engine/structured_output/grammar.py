"""Compiling StructuredOutputsParams into xgrammar CompiledGrammars for one tokenizer, cached by the
format's text. Thread-safe: the engine compiles on a worker thread, the serving ingress on request
threads (to reject a bad format before it reaches a replica)."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from engine.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped); a schema's is ~KBs to MBs
_XGR_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")  # xgrammar's "[12:45:25] file.cc:94: " prefix


class GrammarCompiler:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Iterable[int], max_threads: int = 1
    ) -> None:
        # The model's vocab may be larger than the tokenizer's (padded embeddings): the bitmask must
        # cover every logit, and ids past the tokenizer's are never allowed.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        # xgrammar's own cache is off: ours is bounded by entries and keyed by exactly our inputs.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self.json_token_mask = _no_control_characters(self.tokenizer_info)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def cached(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar | None:
        with self._lock:
            grammar = self._cache.get(params.cache_key)
            if grammar is not None:
                self._cache.move_to_end(params.cache_key)
            return grammar

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar; raises ValueError naming `structured_outputs` when xgrammar rejects it."""
        grammar = self.cached(params)
        if grammar is not None:
            return grammar
        try:
            grammar = self._compile(params)
        except Exception as e:  # xgrammar raises RuntimeError (or its own types) with a C++ location prefix
            detail = _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            raise ValueError(f"structured_outputs: the {params.kind} cannot be compiled: {detail}") from None
        with self._lock:
            self._cache[params.cache_key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind, c = params.kind, self._compiler
        if kind == "json":
            # Compact by default: with free whitespace a weak model can pad forever between tokens. Strict:
            # properties the schema does not name are never generated (disable_additional_properties).
            return c.compile_json_schema(params.text, any_whitespace=params.any_whitespace)
        if kind == "json_object":  # any object, with any keys (non-strict: extra properties allowed)
            return c.compile_json_schema('{"type": "object"}', any_whitespace=params.any_whitespace, strict_mode=False)
        if kind == "regex":
            return c.compile_regex(params.regex)
        if kind == "choice":
            # JSON string escapes are valid EBNF string-literal escapes.
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in params.choice))
        if kind == "structural_tag":
            tag = json.loads(params.structural_tag)
            if "format" in tag:
                return c.compile_structural_tag(params.structural_tag)
            # vLLM's older form: begin/schema/end structures, entered when the text reaches a trigger.
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return c.compile_structural_tag(items, tag["triggers"])
        return c.compile_grammar(params.grammar)


def _no_control_characters(info: xgr.TokenizerInfo) -> torch.Tensor:
    """A bitmask row (xgrammar's layout: bit i of int32 word w is token 32w + i) allowing every token
    but those whose bytes hold a control character (U+0000-U+001F). Compact JSON never contains one
    raw (in strings they must be escaped), yet xgrammar 0.2's rule for length-bounded strings
    (maxLength) lets them through; the manager ANDs this row into JSON requests' masks."""
    allowed = np.ones(-(-info.vocab_size // 32) * 32, dtype=bool)
    for token_id, text in enumerate(info.decoded_vocab):
        if any(byte < 0x20 for byte in text):
            allowed[token_id] = False
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32).copy())
