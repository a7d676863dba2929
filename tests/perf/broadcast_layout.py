"""Where a weight update's time over the link goes (issue 26): the 8B shape's tensors broadcast
from cuda:0 to cuda:1 four ways, each timed over a few rounds (median seconds):

- `flat`: one buffer per ~1 GB bucket (what `taipan bench --workload weight-sync` calls the link);
- `tensors`: every tensor its own broadcast, one by one;
- `coalesced`: every tensor its own broadcast, a bucket's as one coalesced NCCL group (taipan's
  receive path since f485548);
- `staged`: flat buckets through two staging buffers a side, the sender packing bucket i+1 and
  the receiver unpacking bucket i-1 while bucket i is on the link.

    python3 tests/perf/broadcast_layout.py [--rounds 4] [--bucket-mb 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.getcwd())


def llama_8b_sizes() -> list[int]:
    """Element counts of the 8B shape's tensors in HF order (bf16)."""
    h, inter, layers, vocab, kv = 4096, 14336, 32, 128256, 1024
    out = [vocab * h]
    for _ in range(layers):
        out += [h * h, kv * h, kv * h, h * h, inter * h, inter * h, h * inter, h, h]
    return out + [h, vocab * h]


def buckets_of(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    out, size = [[]], 0
    for n in sizes:
        if out[-1] and size + 2 * n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(n)
        size += 2 * n
    return out


def run(rank: int, port: int, args, queue) -> None:
    from taipan.ops.weight_transfer import WeightGroup

    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    group = WeightGroup("127.0.0.1", port, 2, rank, "nccl", dev)
    buckets = buckets_of(llama_8b_sizes(), args.bucket_mb << 20)
    tensors = [[torch.ones(n, dtype=torch.bfloat16, device=dev) for n in b] for b in buckets]
    flats = [torch.empty(sum(b), dtype=torch.bfloat16, device=dev) for b in buckets]
    most = max(sum(b) for b in buckets)
    stage = [torch.empty(most, dtype=torch.bfloat16, device=dev) for _ in range(2)]

    def flat():
        for f in flats:
            group.broadcast(f, 0)

    def one_by_one():
        for b in tensors:
            for t in b:
                group.broadcast(t, 0)

    def coalesced():
        for b in tensors:
            group.broadcast_bucket(b, 0)

    def staged():
        import torch.distributed as dist

        works = []
        opts = dist.BroadcastOptions()
        opts.rootRank = 0

        def post(i):
            buf = stage[i % 2][: sum(buckets[i])]
            if rank == 0:
                if i >= 2:
                    works[i - 2].wait()  # (the buffer is free once bucket i-2 has left)
                torch.cat([t.view(-1) for t in tensors[i]], out=buf)
            works.append(group.group.broadcast([buf], opts))

        def unpack(i):
            works[i].wait()
            if rank != 0:
                buf = stage[i % 2][: sum(buckets[i])]
                parts = list(buf.split(buckets[i]))
                torch._foreach_copy_(tensors[i], parts)

        post(0)
        for i in range(1, len(buckets)):
            post(i)
            unpack(i - 1)
        unpack(len(buckets) - 1)

    out = {}
    for name, fn in (("flat", flat), ("tensors", one_by_one), ("coalesced", coalesced),
                     ("staged", staged)):  # fmt: skip
        seconds = []
        for _ in range(args.rounds + 1):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(dev)
            seconds.append(time.perf_counter() - t0)
        out[name] = statistics.median(seconds[1:])
    if rank == 1:
        ok = all(bool((t == 1).all()) for b in tensors for t in b)
        queue.put({"bytes": 2 * sum(llama_8b_sizes()), "buckets": len(buckets), "ok": ok, **out})
    group.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--bucket-mb", type=int, default=1024)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, port, args, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    row = queue.get(timeout=300)
    for proc in procs:
        proc.join(60)
    row = {"gpu": torch.cuda.get_device_name(0), **row}
    row.update({f"{k}_GBps": row["bytes"] / row[k] / 1e9 for k in ("flat", "tensors",
                "coalesced", "staged")})  # fmt: skip
    print(json.dumps(row))


if __name__ == "__main__":
    main()
