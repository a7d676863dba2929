"""The trainer's side of a weight transfer without disk (`taipan.rl`, DESIGN.md §13).

A trainer and every gpu process of a running taipan join one torch.distributed group (NCCL
between GPUs, gloo on the CPU); the trainer is rank 0 and hosts its rendezvous. Then, per
update, the trainer tells taipan which buckets come (`Client.update_weights_from_distributed`)
and broadcasts them (`send_weights`). `join` and `push_weights` do each pair at once:

    group = taipan.rl.join(client, "127.0.0.1", 29700)         # once
    for step in ...:
        train ...
        client.pause(); taipan.rl.push_weights(client, model, group, weight_version=step)
        client.unpause()

A bucket is a list of (Hugging Face name, dtype, shape) (`ops.weight_transfer.TensorSpec`),
about `bucket_bytes` each; taipan maps every name onto its parameters (fused q/k/v and
gate/up rows, its tensor-parallel shard, its experts) as `update_weights(state=...)` does.

A trainer on the same host as taipan's GPUs needs no group: `push_weights_ipc` shares its CUDA
tensors by CUDA IPC handles (`ipc_handles`, as torch.multiprocessing shares them) and every gpu
process copies its part straight from the trainer's memory (no copy through the host):

    client.pause(); taipan.rl.push_weights_ipc(client, model, weight_version=step)
    client.unpause()

No torch here: the torch side is ops/weight_transfer.py, imported when a function is called.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterable
from typing import Any

DEFAULT_BUCKET_BYTES = 1 << 30


def named_tensors(model_or_named: Any) -> list[tuple[str, Any]]:
    """(name, tensor) pairs of a torch module (its state dict: parameters and buffers, each
    shared tensor once) or of an iterable of pairs or a dict, as given."""
    if hasattr(model_or_named, "state_dict"):
        seen, out = set(), []
        for name, tensor in model_or_named.state_dict().items():
            if tensor.data_ptr() in seen or not tensor.is_floating_point():
                continue  # a tied weight comes once; integer buffers are not weights
            seen.add(tensor.data_ptr())
            out.append((name, tensor))
        return out
    if isinstance(model_or_named, dict):
        return list(model_or_named.items())
    return list(model_or_named)


def weight_buckets(model_or_named: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list]:
    """The buckets `send_weights` will broadcast, for `update_weights_from_distributed`."""
    from taipan.ops.weight_transfer import plan_buckets

    return plan_buckets(named_tensors(model_or_named), bucket_bytes)


def init_weight_transfer_group(
    master_address: str,
    master_port: int,
    world_size: int,
    *,
    backend: str | None = None,
    device: Any = None,
    rank: int = 0,
    timeout_s: float = 60.0,
):
    """Join the group as the trainer's sender `rank` (0 hosts the rendezvous). `backend` None:
    "nccl" when `device` is CUDA, else "gloo"; `device` None: the current CUDA device if any."""
    from taipan.ops.weight_transfer import trainer_group

    return trainer_group(
        master_address, master_port, world_size, backend=backend, device=device, rank=rank,
        timeout_s=timeout_s,
    )  # fmt: skip


def send_weights(
    model_or_named: Any, group, buckets: Iterable[list] | None = None, *, bucket_bytes=None
) -> list[list]:
    """Broadcast every bucket from this rank (`buckets` None: `weight_buckets` of the model);
    returns the buckets sent."""
    named = dict(named_tensors(model_or_named))
    if buckets is None:
        buckets = weight_buckets(named, bucket_bytes or DEFAULT_BUCKET_BYTES)
    buckets = list(buckets)
    for specs in buckets:
        group.send(specs, {s.name: named[s.name] for s in specs})
    group.synchronize()  # every broadcast done: the trainer may change its weights again
    return buckets


def join(client, master_address: str, master_port: int, **kwargs):
    """`client.init_weight_transfer` and the trainer's own `init_weight_transfer_group` at once
    (each waits for the other): returns the trainer's group. The world is the trainer (rank 0)
    plus every gpu process of the runtime (`client.weight_transfer_world_size()` - 1 of them)."""
    world = client.weight_transfer_world_size()
    backend = kwargs.pop("backend", None)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            client.init_weight_transfer,
            master_address,
            master_port,
            world,
            rank_offset=1,
            backend=backend,
        )
        group = init_weight_transfer_group(
            master_address, master_port, world, backend=backend, **kwargs
        )
        joined.result()
    return group


def push_weights(
    client,
    model_or_named: Any,
    group,
    *,
    weight_version: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    stage: bool = False,
    timings: dict | None = None,
    in_flight: bool = False,
    draft: bool = False,
):
    """Send the trainer's weights to a paused (or suspended) runtime, or with `in_flight` to
    a running one too (no pause and unpause around it: the update runs between two steps and
    the requests in flight take the new weights from the next step): the client's
    `update_weights_from_distributed` and the broadcasts at once. Returns its ControlAck.
    `draft`: the weights are the runtime's draft model's (its speculative_model; HF names of
    the draft's checkpoint), the target's stay.
    `timings` (a dict, optional) gets where the time went, in seconds from the call:
    `checked` (the state check done), `command_sent` (the update command has left), `sent`
    (every broadcast done on this side), `acked`; and
    `wall_start`, the call's wall-clock time (to set beside the gpu actors' logged marks).

    A runtime that is not paused (nor running, `in_flight`) is refused here, before any
    broadcast (taipan would refuse the update, and the trainer would wait in its first
    broadcast until the group's timeout)."""
    start = time.perf_counter()
    if draft and not client.has_draft_weights():
        raise RuntimeError(
            "push_weights(draft=True) needs a draft model with weights of its own "
            "(speculative_method='draft_model' and a speculative_model path or name)"
        )  # (refused before any broadcast, as below: the trainer would wait out its group)
    state = str(client.stats(fresh=False).state)  # (the coordinator's own: one hop)
    legal = ("PAUSED", "SUSPENDED", "RUNNING") if in_flight else ("PAUSED", "SUSPENDED")
    if state not in legal:
        raise RuntimeError(
            f"push_weights needs a PAUSED or SUSPENDED runtime (or in_flight=True); it is {state}"
        )
    named = named_tensors(model_or_named)
    buckets = weight_buckets(named, bucket_bytes)
    marks = {
        "checked": time.perf_counter() - start,
        "wall_start": time.time() - (time.perf_counter() - start),
    }
    sent = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        update = pool.submit(
            client.update_weights_from_distributed,
            buckets,
            weight_version=weight_version,
            stage=stage,
            on_sent=sent.set,
            in_flight=in_flight,
            draft=draft,
        )
        # The command leaves before the first broadcast: enqueueing them holds this process's
        # GIL for tens of ms, and the client's threads, starved of it, sent the command ~14 ms
        # late (8B shape, H100): the receivers, and so the link, started that much later.
        while not sent.wait(0.05):
            if update.done():
                update.result()  # refused or failed before it left: raise it here
                break
        marks["command_sent"] = time.perf_counter() - start
        try:
            send_weights(named, group, buckets)
        except Exception:
            update.cancel()
            raise
        marks["sent"] = time.perf_counter() - start
        ack = update.result()
    marks["acked"] = time.perf_counter() - start
    if timings is not None:
        timings.update(marks)
    return ack


def ipc_handles(model_or_named: Any) -> list:
    """The CUDA IPC records (messages/lifecycle.py IpcTensor) of the trainer's CUDA tensors, for
    `update_weights_from_ipc`; they point at the tensors' memory, which must stay alive and
    unchanged until the update is acknowledged."""
    from taipan.ops.weight_transfer import ipc_handles as handles

    return handles(named_tensors(model_or_named))


def push_weights_ipc(
    client,
    model_or_named: Any,
    *,
    weight_version: int | None = None,
    stage: bool = False,
    timings: dict | None = None,
    in_flight: bool = False,
    draft: bool = False,
):
    """Send the trainer's CUDA tensors to a paused (or suspended; `in_flight`: also running, as
    `push_weights`; `draft`: the draft model's, as `push_weights`) runtime on the same host by
    CUDA IPC handles: `ipc_handles` and the client's `update_weights_from_ipc`, the tensors kept
    alive until the ack (which comes once every gpu process has copied its part and dropped
    its views). The tensors are read after the work queued on the trainer's current CUDA
    stream. Returns the ControlAck; `timings` (optional) gets `shared` (the records made) and
    `acked`, seconds from the call."""
    start = time.perf_counter()
    named = named_tensors(model_or_named)  # (holds every tensor until the ack)
    records = ipc_handles(named)
    shared = time.perf_counter() - start
    ack = client.update_weights_from_ipc(
        records, weight_version=weight_version, stage=stage, in_flight=in_flight, draft=draft
    )
    if timings is not None:
        timings.update(shared=shared, acked=time.perf_counter() - start)
    del named  # only now may the trainer's tensors go
    return ack
