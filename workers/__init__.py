"""Worker side: the engine model, the simulated worker process, and (later) the vLLM worker adapter.

Installs with a minimal dependency set so it can live inside vLLM's own environment; imports nothing from
`switchyard.router`.
"""
