"""Paged KV block allocator: `prefix.PrefixBlockPool` (pure; prefix caching on or off) and
`actor.AllocatorActor` (the shell).

Import the shell from `actors.allocator.actor`; this package only re-exports the pure core so that
importing it pulls in neither zmq nor the actor runtime.
"""

from taipan.actors.allocator.core import AllocatorError
from taipan.actors.allocator.prefix import PrefixBlockPool

__all__ = ["AllocatorError", "PrefixBlockPool"]
