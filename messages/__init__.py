"""The wire: every message type, the msgpack codec and validation. Imports no torch.

Importing this package registers every message family, so `decode` knows every tag.
"""

from taipan.messages import (  # noqa: F401
    allocator,
    common,
    consensus,
    gpu,
    lifecycle,
    mamba_cache,
    requests,
    stats,
)
from taipan.messages.codec import MessageError, decode, encode, registry

__all__ = ["MessageError", "decode", "encode", "registry"]
