import time

import numpy as np
import torch

from taipan.actors.gpu.host_staging import Arenas, active, to_device
from tests.test_host_staging import ARRAYS

dev = torch.device("cuda")
big = np.arange(1024, dtype=np.int64)
arenas = Arenas(3, nbytes=4096)
for rnd in range(3):
    times = []
    torch.cuda._sleep(100_000_000)
    with active(arenas.next()):
        for a in ARRAYS:
            t0 = time.perf_counter()
            to_device(a, dev)
            times.append(round((time.perf_counter() - t0) * 1e3, 2))
        t0 = time.perf_counter()
        to_device(big, dev, torch.float32)
        times.append(round((time.perf_counter() - t0) * 1e3, 2))
        t0 = time.perf_counter()
        to_device(big, dev)
        times.append(round((time.perf_counter() - t0) * 1e3, 2))
    torch.cuda.synchronize()
    print("round", rnd, "ms each:", times, [a.dtype.str for a in ARRAYS], flush=True)
