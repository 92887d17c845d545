"""Anchor for //benchmarks:pipe_cpu: PyTorch's old torch.distributed.pipeline.sync.Pipe (one worker
thread for all CPU partitions) on the same configurations, measured with the same definitions
(anchor_common.py): alternating rounds, (a) CPU overhead per action, (b) wall overhead per action
pinned to one core, (d) speed against its own whole-batch step. Prints `key=value` lines."""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipeline.sync import Pipe  # noqa: E402

from anchor_common import PinnedToOneCore, loaded_blas, median, rounds  # noqa: E402


def step(model, x, t):
    out = model(x)
    if hasattr(out, "local_value"):
        out = out.local_value()
    nn.functional.mse_loss(out, t).backward()


def microbatch_loop(model, x, t, chunks):
    for xc, tc in zip(x.chunk(chunks), t.chunk(chunks)):
        (nn.functional.mse_loss(model(xc), tc) * (xc.size(0) / x.size(0))).backward()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.NamedTemporaryFile() as f:
        rpc.init_rpc("anchor", rank=0, world_size=1,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                         init_method=f"file://{f.name}"))
        # (a, b) overhead: 4 stages of Linear(16,16), batch 32, chunks 32, no checkpointing.
        layers = [nn.Linear(16, 16) for _ in range(4)]
        seq = nn.Sequential(*layers)
        pipe = Pipe(nn.Sequential(*[nn.Sequential(l) for l in layers]), chunks=32,
                    checkpoint="never")
        x, t = torch.randn(32, 16), torch.randn(32, 16)
        actions = 4 * 32 * 2
        variants = {"loop": lambda: microbatch_loop(seq, x, t, 32),
                    "pipe": lambda: step(pipe, x, t)}
        free = rounds(variants, args.rounds, calls=5)
        with PinnedToOneCore():
            pinned = rounds(variants, args.rounds, calls=5)
        print(f"a_cpu_overhead_us={median([(p[1] - l[1]) / actions for p, l in zip(free['pipe'], free['loop'])]):.3f}")
        print(f"a_pinned_overhead_us={median([(p[0] - l[0]) / actions for p, l in zip(pinned['pipe'], pinned['loop'])]):.3f}")

        # (d) speed: 2 stages of Linear(512,512), ReLU, Linear(512,512), ReLU; batch 128, chunks 8.
        def stage():
            return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
        s0, s1 = stage(), stage()
        pipe = Pipe(nn.Sequential(s0, s1), chunks=8, checkpoint="never")
        whole = nn.Sequential(s0, s1)
        x, t = torch.randn(128, 512), torch.randn(128, 512)
        speed = rounds({"pipe": lambda: step(pipe, x, t), "whole": lambda: step(whole, x, t)},
                       args.rounds, calls=3)
        print(f"d_pipe_us={median([w for w, _ in speed['pipe']]):.1f}")
        print(f"d_whole_us={median([w for w, _ in speed['whole']]):.1f}")
        rpc.shutdown()
    print(f"torch_version {torch.__version__}")
    print(f"blas {loaded_blas()}")


if __name__ == "__main__":
    sys.exit(main())
