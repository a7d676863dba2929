"""Mamba state slots and prefix snapshots: `core.MambaSlotPool` (pure) and
`actor.MambaCacheActor` (the shell). Import the shell from `actors.mamba_cache.actor`; this
package only re-exports the pure core.
"""

from taipan.actors.mamba_cache.core import MambaCacheError, MambaSlotPool

__all__ = ["MambaCacheError", "MambaSlotPool"]
