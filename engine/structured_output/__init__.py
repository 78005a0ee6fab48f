"""Structured outputs: grammars compiled by xgrammar (grammar.py) and, per step, token bitmasks from
each constrained sample's matcher (manager.py). The request-facing parameters are
engine.sampling_params.StructuredOutputsParams."""

from engine.structured_output.grammar import GrammarCompiler
from engine.structured_output.manager import StructuredOutputManager

__all__ = ["GrammarCompiler", "StructuredOutputManager"]
