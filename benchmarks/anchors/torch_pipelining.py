"""Anchor for //benchmarks:distributed_cpu: torch.distributed.pipelining's GPipe (PyTorch >= 2.4)
on the same configuration, over Gloo with 2 local processes, one intra-op thread each: 2 stages of
Linear(512,512), ReLU, Linear(512,512), ReLU; batch 128, 8 micro-batches; one timed step is
forward and backward of the whole batch (gradients zeroed before each step, no optimizer step).
Prints `key=value` lines for the C++ benchmark to read; `torch_pipelining_us=nan` (with the
reason) where the module cannot be imported, as on PyTorch 1.13, or the run fails or hangs.

    python3 benchmarks/anchors/torch_pipelining.py [--rounds 20] [--timeout 300]
"""

import argparse
import os
import socket
import statistics
import sys
import time


def nan(reason):
    print(f"torch_pipelining_reason={reason}")
    print("torch_pipelining_us=nan")
    print("torch_pipelining_min_us=nan")
    print("torch_pipelining_max_us=nan")
    return 0


def stage_module(torch, seed):
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())


def rank_main(rank, port, rounds, queue):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ.setdefault("USE_LIBUV", "0")  # Debian's PyTorch has no libuv store
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    module = stage_module(torch, seed=rank)
    batch, chunks = 128, 8
    try:
        stage = PipelineStage(module, rank, 2, torch.device("cpu"),
                              input_args=(torch.randn(batch // chunks, 512),))
    except TypeError:  # versions that infer the shapes themselves
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=chunks,
                             loss_fn=lambda out, target: torch.nn.functional.mse_loss(out, target))
    torch.manual_seed(0)
    x, t = torch.randn(batch, 512), torch.randn(batch, 512)

    def step():
        module.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=t, losses=[])

    for _ in range(3):
        step()
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e6)
    # A step ends on rank 1 (last stage) after its backward; rank 0's time includes waiting for
    # the last gradient, so rank 0's times are the step's.
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    try:
        import torch
        import torch.distributed.pipelining  # noqa: F401
        import torch.multiprocessing as mp
    except Exception as e:  # PyTorch < 2.4 has no torch.distributed.pipelining
        return nan(f"import torch.distributed.pipelining failed ({type(e).__name__})")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, args.rounds, queue)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.time() + args.timeout
    times = None
    try:
        times = queue.get(timeout=args.timeout)
    except Exception:
        pass
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.time()))
        if p.is_alive():
            p.kill()
            p.join()
    if not times:
        return nan(f"no result within {args.timeout:.0f} s or a rank failed")
    print(f"torch_version={torch.__version__}")
    print(f"torch_pipelining_us={statistics.median(times):.1f}")
    print(f"torch_pipelining_min_us={min(times):.1f}")
    print(f"torch_pipelining_max_us={max(times):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
