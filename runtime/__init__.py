"""taipan, the top layer (the repository's runtime/ folder): launcher, process entry points, CLI,
client library, replay tooling, bench, and the public Python API.

    from taipan import LLM, AsyncLLM, Client, AsyncClient, SamplingParams

Names are imported lazily so that `taipan.procs` and friends start fast.
"""

from __future__ import annotations

_EXPORTS = {
    "Client": "taipan.client",
    "AsyncClient": "taipan.client",
    "Completion": "taipan.client",
    "Delta": "taipan.client",
    "RequestError": "taipan.client",
    "ControlError": "taipan.client",
    "RuntimeUnreachable": "taipan.client",
    "ControlAck": "taipan.messages.lifecycle",
    "SamplingParams": "taipan.messages.requests",
    "StructuredOutput": "taipan.messages.requests",
    "BeamSearchParams": "taipan.beam_search",
    "InferenceConfig": "taipan.actors.config",
    "ConfigError": "taipan.actors.config",
    "Runtime": "taipan.launcher",
    "LLM": "taipan.llm",
    "AsyncLLM": "taipan.llm",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
