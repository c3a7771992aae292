"""Switchyard: an LLM request router daemon (router, workers, simulator) in one import namespace."""

__version__ = "0.1.0"
