"""Paged KV block allocator: `core.BlockPool` (pure) and `actor.AllocatorActor` (the shell).

Import the shell from `actors.allocator.actor`; this package only re-exports the pure core so that
importing it pulls in neither zmq nor the actor runtime.
"""

from taipan.actors.allocator.core import AllocatorError, BlockPool

__all__ = ["AllocatorError", "BlockPool"]
