"""Structured outputs: constraints (:class:`StructuredOutputs`) enforced by grammar masks."""

from xinfer.grammar.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
