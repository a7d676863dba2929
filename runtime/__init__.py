"""The runtime: actor base, channels, launcher, config, recording, CLI and the public Python API.

    from runtime import Client, AsyncClient, SamplingParams

Names are imported lazily so that `runtime.procs` and friends start fast.
"""

from __future__ import annotations

_EXPORTS = {
    "Client": "runtime.client",
    "AsyncClient": "runtime.client",
    "Completion": "runtime.client",
    "Delta": "runtime.client",
    "RequestError": "runtime.client",
    "ControlError": "runtime.client",
    "ControlAck": "messages.lifecycle",
    "SamplingParams": "messages.requests",
    "InferenceConfig": "runtime.config",
    "ConfigError": "runtime.config",
    "Runtime": "runtime.launcher",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
