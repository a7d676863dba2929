"""Lifecycle family (tags 40-59): control messages the coordinator drives.

Flow: a client sends a control message to the coordinator; the coordinator checks it against its
FSM (actors/coordinator/fsm.py), forwards it to every engine, and answers the client with one
`ControlAck` once every engine has acknowledged (or an `ErrorReply` with code
"illegal_transition" naming the current state, or "control_failed"). Engines answer the
coordinator with `ControlAck` (or `ErrorReply`).

States: RUNNING -PAUSE-> PAUSED -SUSPEND-> SUSPENDED -RESUME-> PAUSED -UNPAUSE-> RUNNING;
STOP from PAUSED or SUSPENDED; UPDATE_WEIGHTS only while SUSPENDED.
- PAUSED: no steps run; requests keep their KV; new submissions queue.
- SUSPENDED: the big tensors are released as `mode` says (None: the config's
  `kv_cache_management_mode`, itself defaulting to "persist"): "persist" keeps them, "offload"
  copies the KV cache to CPU memory and frees the device copy, "recompute" drops it (running
  requests re-prefill on resume).
"""

from __future__ import annotations

import numpy as np

from taipan.messages.codec import message


@message(40)
class Stop:
    """Shut down: abort every request (each gets its terminal output), then exit."""

    reason: str


@message(41)
class StopAck:
    name: str


@message(42)
class Pause:
    """Finish the step in flight, then run no more steps until Unpause."""


@message(43)
class Unpause:
    pass


@message(44)
class Suspend:
    """Release the big tensors; `mode` in ("persist", "offload", "recompute") or None."""

    mode: str | None


@message(45)
class Resume:
    """Re-allocate (or copy back) what Suspend released; the runtime is PAUSED afterwards."""


@message(46)
class UpdateWeights:
    """Load new weights while SUSPENDED: from `path` (a GGUF file or a Hugging Face directory
    with the same architecture) or from `state` (parameter name -> array, HF names as in the
    checkpoint, e.g. "model.layers.0.mlp.down_proj.weight"; a subset is allowed). Exactly one
    of the two is set. Bumps the weight version."""

    path: str | None
    state: dict[str, np.ndarray] | None


@message(47)
class ControlAck:
    """`command`: "pause", "unpause", "suspend", "resume", "update_weights" or "stop";
    `state`: the FSM state after it; `weight_version`: the weights now loaded (0 = as started)."""

    command: str
    state: str
    weight_version: int
