"""Errors raised when an adapter's files are malformed or do not fit the base model."""

from __future__ import annotations


class AdapterFormatError(ValueError):
    """The adapter is not a PEFT LoRA adapter that lorafleet can serve; the message says why."""


class BaseModelMismatch(AdapterFormatError):
    """A well-formed adapter whose shapes or layers do not fit the configured base model."""
