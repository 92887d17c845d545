"""Anchor for //benchmarks:pipe_cpu: PyTorch's own torch.distributed.pipeline.sync.Pipe on the
same configurations, timed the same way (warm-up, then the median of 20 iterations, one intra-op
thread). Prints `key=value` lines for the C++ benchmark to read."""

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.pipeline.sync import Pipe


def median_us(fn, iterations=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def step(model, x, t):
    out = model(x)
    if hasattr(out, "local_value"):
        out = out.local_value()
    loss = nn.functional.mse_loss(out, t)
    loss.backward()


def microbatch_loop(model, x, t, chunks):
    for xc, tc in zip(x.chunk(chunks), t.chunk(chunks)):
        (nn.functional.mse_loss(model(xc), tc) * (xc.size(0) / x.size(0))).backward()


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.NamedTemporaryFile() as f:
        rpc.init_rpc("anchor", rank=0, world_size=1,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"file://{f.name}"))
        # (a) overhead: 4 stages of Linear(16,16), batch 32, chunks 32, no checkpointing.
        layers = [nn.Linear(16, 16) for _ in range(4)]
        seq = nn.Sequential(*layers)
        pipe = Pipe(nn.Sequential(*[nn.Sequential(l) for l in layers]), chunks=32, checkpoint="never")
        x, t = torch.randn(32, 16), torch.randn(32, 16)
        seq_us = median_us(lambda: microbatch_loop(seq, x, t, 32))
        pipe_us = median_us(lambda: step(pipe, x, t))
        print(f"a_sequential_us={seq_us:.1f}")
        print(f"a_pipe_us={pipe_us:.1f}")
        print(f"a_overhead_us_per_cell={(pipe_us - seq_us) / (32 * 4):.2f}")

        # (b) speed: 2 stages of Linear(512,512), ReLU, Linear(512,512), ReLU; batch 128, chunks 8.
        def stage():
            return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
        s0, s1 = stage(), stage()
        pipe = Pipe(nn.Sequential(s0, s1), chunks=8, checkpoint="never")
        x, t = torch.randn(128, 512), torch.randn(128, 512)
        print(f"b_pipe_us={median_us(lambda: step(pipe, x, t)):.1f}")
        print(f"b_sequential_us={median_us(lambda: step(nn.Sequential(s0, s1), x, t)):.1f}")
        rpc.shutdown()
    print(f"torch_version={torch.__version__}")


if __name__ == "__main__":
    sys.exit(main())
