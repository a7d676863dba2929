"""The `weight-sync` workload of `taipan bench`: new weights from a trainer's process into a
running taipan, timed beside the raw link (DESIGN.md §13, issue 26's acceptance).

The trainer is this process, on `--trainer-device` (cuda:0; taipan on `--device`, and with
`--tensor-parallel-size` / `--data-parallel-size` on the GPUs after it, none of them the
trainer's; on a CPU all are the CPU and the group is gloo). It holds a Hugging Face model with
exactly the weights taipan started with (`random:<shape>`, ops/hf_bench.py `hf_random_model`),
scaled a little per round so every round carries new weights.

1. The link alone: the same buckets broadcast from the trainer to one plain receiving process
   on each of taipan's devices (`ops.weight_transfer.time_broadcasts`), before taipan starts.
2. taipan starts, joins the trainer's group (`taipan.rl.join`), and takes one warm-up update.
3. `--sync-rounds` timed rounds: pause -> `push_weights` (weight_version = 100 + round) ->
   unpause (`--in-flight`: push_weights(in_flight=True) alone, the runtime left RUNNING),
   then a greedy request of CHECK_TOKENS tokens, compared with the trainer's HF model's
   (`greedy_equal_rounds`; informative: bf16 near ties may differ. The CPU tests prove the
   weights exact: tests/test_gpu_weight_transfer.py, tests/test_rl.py).

4. With `--sync-path`: one more update, through a checkpoint the trainer saves to disk
   (`update_weights(path=...)`, pause to unpause: `path_update_s`), for comparison.

Row: `broadcast_s` (median of the link rounds), `update_s` (pause to unpause acked),
`paused_s` (pause acked to unpause acked), `transfer_s` (push_weights), their ratios, the link's
GB/s. A link faster than any interconnect (LINK_GBPS_MAX) marks the row invalid.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import sys
import time

from taipan.bench.common import greedy, rounded

LINK_GBPS_MAX = 2000.0  # above NVLink 4's 900 GB/s both ways: a timing bug, not a link
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
CHECK_TOKENS = 8


def _say(text: str) -> None:
    print(f"weight-sync: {text}", file=sys.stderr, flush=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_devices(args) -> list[str]:
    """The device of every gpu process taipan will start (each rank's tensor-parallel peers)."""
    from taipan.placement import peer_devices

    dp, tp = args.data_parallel_size, args.tensor_parallel_size
    return [d for r in range(dp) for d in peer_devices(args.device, r, dp, tp)]


def _link_seconds(args, sizes: list[int], repeats: int) -> list[float]:
    """The raw broadcast of `sizes` from the trainer to one plain process on each of the
    devices taipan's gpu processes will use."""
    from taipan.ops.weight_transfer import WeightGroup, link_receiver, time_broadcasts

    port, devices = _port(), _gpu_devices(args)
    world = 1 + len(devices)
    receivers = [
        mp.get_context("spawn").Process(
            target=link_receiver, args=("127.0.0.1", port, 1 + i, dev, sizes, repeats, world)
        )
        for i, dev in enumerate(devices)
    ]
    for receiver in receivers:
        receiver.start()
    try:
        backend = "nccl" if args.trainer_device.startswith("cuda") else "gloo"
        group = WeightGroup("127.0.0.1", port, world, 0, backend, args.trainer_device)
        seconds = time_broadcasts(group, sizes, repeats)
        group.close()
    finally:
        for receiver in receivers:
            receiver.join(60)
            if receiver.is_alive():
                receiver.kill()
    return seconds


def weight_sync_workload(args) -> list[dict]:
    from taipan import rl
    from taipan.client import Client
    from taipan.launcher import runtime_from_args
    from taipan.models import resolve
    from taipan.ops import hf_bench as hf
    from taipan.ops.hardware import as_dtype, gpu_name

    if args.trainer_device is None:
        args.trainer_device = "cuda:0" if args.device.startswith("cuda") else "cpu"
    name, model_path = resolve(args.model)
    if not model_path.startswith("random:"):
        raise ValueError(f"--workload weight-sync needs a random:<shape> model, got {args.model}")
    if args.device.startswith("cuda") and args.trainer_device in _gpu_devices(args):
        raise ValueError(
            f"--workload weight-sync: --trainer-device {args.trainer_device} is one of taipan's "
            f"GPUs ({', '.join(_gpu_devices(args))}): give it a GPU of its own"
        )
    trainer = hf.hf_random_model(model_path, as_dtype(args.dtype), args.trainer_device)
    hf.never_stop_at_eos(trainer)
    named = rl.named_tensors(trainer)
    buckets = rl.weight_buckets(named, args.bucket_mb << 20)
    sizes = [sum(-(-s.nbytes // 256) * 256 for s in b) for b in buckets]
    _say(f"{sum(sizes) / 1e9:.2f} GB in {len(buckets)} buckets; timing the link alone")
    link = _link_seconds(args, sizes, args.sync_rounds + 1)[1:]  # the first builds the rings
    _say(f"link {statistics.median(link):.4f} s; starting taipan on {args.device}")
    rounds = []
    with runtime_from_args(args) as rt, Client(rt.address) as client:
        group = rl.join(client, "127.0.0.1", _port())
        _say("taipan joined the trainer's group")
        for r in range(args.sync_rounds + 1):  # round 0: the warm-up
            hf.scale_weights(trainer, 1.01)
            t0 = time.perf_counter()
            if not args.in_flight:
                client.pause()
            t1 = time.perf_counter()
            marks = {}
            ack = rl.push_weights(client, named, group, weight_version=100 + r,
                                  bucket_bytes=args.bucket_mb << 20, timings=marks,
                                  in_flight=args.in_flight)  # fmt: skip
            t2 = time.perf_counter()
            if not args.in_flight:
                client.unpause()
            t3 = time.perf_counter()
            if ack.weight_version != 100 + r:
                raise RuntimeError(f"round {r}: taipan reports version {ack.weight_version}")
            [done] = client.generate([PROMPT], greedy(CHECK_TOKENS))
            same = list(done.token_ids) == hf.greedy_ids(trainer, PROMPT, CHECK_TOKENS)
            _say(f"round {r}: update {t3 - t0:.4f} s, transfer {t2 - t1:.4f} s, greedy {same}; "
                 + ", ".join(f"{k} at {v:.4f} s" for k, v in marks.items()))  # fmt: skip
            rounds.append((t3 - t0, t3 - t1, t2 - t1, same, marks))
        client.close_weight_transfer()
        group.close()
        path_round = _path_round(args, client, trainer) if args.sync_path else None
    timed = rounds[1:]
    total = sum(sizes)
    row = {
        "workload": "weight-sync",
        "model": name,
        "gpu": gpu_name(args.device),
        "batch": None,  # no batch: a transfer
        "dtype": args.dtype,
        "device": args.device,
        "trainer_device": args.trainer_device,
        "data_parallel_size": args.data_parallel_size,
        "tensor_parallel_size": args.tensor_parallel_size,
        "bytes": total,
        "buckets": len(buckets),
        "bucket_mb": args.bucket_mb,
        "in_flight": bool(args.in_flight),  # no pause and unpause around each update
        "rounds": len(timed),
        "broadcast_s": statistics.median(link),
        "update_s": statistics.median(t[0] for t in timed),
        "paused_s": statistics.median(t[1] for t in timed),
        "transfer_s": statistics.median(t[2] for t in timed),
        "greedy_equal_rounds": sum(t[3] for t in timed),
        # Within push_weights: the state check done, the trainer's broadcasts done, the ack.
        **{f"{k}_s": statistics.median(t[4][k] for t in timed) for k in ("checked", "sent")},
    }
    if path_round is not None:
        row["path_update_s"], row["path_greedy_equal"] = path_round
        row["path_vs_broadcast"] = row["path_update_s"] / row["broadcast_s"]
    row["link_GBps"] = total / row["broadcast_s"] / 1e9
    row["update_vs_broadcast"] = row["update_s"] / row["broadcast_s"]
    row["paused_vs_transfer"] = row["paused_s"] / row["transfer_s"]
    if row["link_GBps"] > LINK_GBPS_MAX:
        row["invalid"] = f"the link moved {row['link_GBps']:.0f} GB/s: a timing bug"
    return [rounded(row)]


def _path_round(args, client, trainer) -> tuple[float, bool]:
    """The same update through a checkpoint on disk (`update_weights(path=...)`), for
    comparison: the trainer saves its model (not timed), then pause -> update -> unpause."""
    import tempfile

    from taipan.ops import hf_bench as hf

    hf.scale_weights(trainer, 1.01)
    with tempfile.TemporaryDirectory(prefix="taipan-weight-sync-") as path:
        hf.save_checkpoint(trainer, path)
        _say(f"saved the trainer's model to {path}; updating from it")
        t0 = time.perf_counter()
        client.pause()
        client.update_weights(path=path, weight_version=1000)
        client.unpause()
        seconds = time.perf_counter() - t0
    [done] = client.generate([PROMPT], greedy(CHECK_TOKENS))
    same = list(done.token_ids) == hf.greedy_ids(trainer, PROMPT, CHECK_TOKENS)
    _say(f"path update {seconds:.4f} s, greedy {same}")
    return seconds, same


def weight_sync_summary(row: dict) -> str:
    return (
        f"weight-sync {row['bytes'] / 1e9:.2f} GB in {row['buckets']} buckets: link "
        f"{row['broadcast_s']} s ({row['link_GBps']} GB/s), update {row['update_s']} s "
        f"({row['update_vs_broadcast']}x), paused {row['paused_s']} s, greedy equal in "
        f"{row['greedy_equal_rounds']}/{row['rounds']} rounds"
        + (f"; from a path {row['path_update_s']} s" if "path_update_s" in row else "")
    )
