"""Micro-benchmarks of the hot paths in ext/ (`switchyard bench radix`, ...)."""
