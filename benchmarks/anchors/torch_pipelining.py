"""Anchor for //benchmarks:pipe_cpu: torch.distributed.pipelining (PyTorch >= 2.4; Debian 13's
python3-torch 2.6), the pipeline a PyTorch user picks today. One process per stage over Gloo,
ScheduleGPipe, on the configurations of pipe_cpu, measured with the same definitions
(anchor_common.py, docs/benchmarks.md):
  (a) CPU overhead per action: process CPU time of all stage processes during a step, minus the
      CPU time of the same micro-batch loop in one process, divided by the F and B actions;
  (b) the same in wall time with every process pinned to one core;
  (d) wall time of a GPipe step, and this anchor's own whole-batch and micro-batch-loop steps
      (one process, one thread) for the cross-check against the C++ ones.
Schedule1F1B hangs on Gloo (batched send/recv on a non-NCCL backend, PyTorch issue 132644): it
runs in its own processes under a timeout and is reported as finished (1) or timed out (0).
Prints `key=value` lines (pipe_cpu reads a_* and d_*; torch_pipelining_* are the same GPipe step
under the names //benchmarks:distributed_cpu reads), all nan where the module is missing. Needs
USE_LIBUV=0 with Debian 13's torch (built without libuv), which it sets.

    python3 benchmarks/anchors/torch_pipelining.py [--rounds 7] [--timeout 600] [--configs a,d]
        [--no-one-f-one-b] [--retries 0]
//benchmarks:distributed_cpu needs only configuration d's GPipe step: `--configs d
--no-one-f-one-b`. Its GPipe step over Gloo hangs now and then (2 launches of 3 on 2026-11-23,
PyTorch 2.6, configuration d); `--timeout S --retries N` bounds each launch and relaunches."""

import argparse
import multiprocessing
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("USE_LIBUV", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from anchor_common import PinnedToOneCore, loaded_blas, median  # noqa: E402


def make_model(config):
    """The full model, one nn.Sequential per stage, same seed on every rank."""
    torch.manual_seed(0)
    if config == "a":
        return [nn.Sequential(nn.Linear(16, 16)) for _ in range(4)], 32, 32, 16
    def block():
        return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
    return [block(), block()], 128, 8, 512


def mse(out, target):
    return nn.functional.mse_loss(out, target)


def microbatch_loop(model, x, t, chunks):
    for xc, tc in zip(x.chunk(chunks), t.chunk(chunks)):
        (mse(model(xc), tc) * (xc.size(0) / x.size(0))).backward()


def whole_step(model, x, t):
    mse(model(x), t).backward()


def worker(rank, world, init_file, config, schedule_name, n_rounds, results):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    stages, batch, chunks, width = make_model(config)
    x, t = torch.randn(batch, width), torch.randn(batch, width)
    micro = torch.empty(batch // chunks, width)
    stage = PipelineStage(stages[rank], rank, world, torch.device("cpu"),
                          input_args=(micro,), output_args=micro)
    kind = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
    schedule = kind(stage, chunks, loss_fn=mse)
    sequential = nn.Sequential(*stages)

    def pipe_step():
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=t, losses=[])
        else:
            schedule.step()

    def timed(fn, calls, only_rank0):
        """Wall time per call (rank 0's clock, between barriers) and CPU time per call, summed
        over the ranks that run `fn`."""
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        if not only_rank0 or rank == 0:
            for _ in range(calls):
                fn()
        dist.barrier()
        wall = (time.perf_counter() - t0) * 1e6 / calls
        cpu = torch.tensor([(time.process_time() - c0) * 1e6 / calls])
        if only_rank0 and rank != 0:
            cpu.zero_()
        dist.all_reduce(cpu)
        return wall, cpu.item()

    variants = {"pipe": (pipe_step, False),
                "loop": (lambda: microbatch_loop(sequential, x, t, chunks), True)}
    if config == "d":
        variants["whole"] = (lambda: whole_step(sequential, x, t), True)
    names = list(variants)
    calls = 5 if config == "a" else 3

    def run_rounds():
        out = {n: [] for n in names}
        for n in names:  # warm-up
            timed(variants[n][0], 1, variants[n][1])
        for r in range(n_rounds):
            for k in range(len(names)):
                n = names[(r + k) % len(names)]
                out[n].append(timed(variants[n][0], calls, variants[n][1]))
        return out

    if schedule_name == "one_f_one_b":
        pipe_step()  # hangs on Gloo in PyTorch 2.4-2.6; the parent's timeout reports it
        wall, _ = timed(pipe_step, 1, False)
        if rank == 0:
            results["d_one_f_one_b_us"] = wall
        dist.destroy_process_group()
        return

    free = run_rounds()
    actions = world * chunks * 2
    with PinnedToOneCore():
        pinned = run_rounds()
    if rank == 0:
        results[f"{config}_cpu_overhead_us"] = median(
            [(p[1] - l[1]) / actions for p, l in zip(free["pipe"], free["loop"])])
        results[f"{config}_pinned_overhead_us"] = median(
            [(p[0] - l[0]) / actions for p, l in zip(pinned["pipe"], pinned["loop"])])
        for n in names:
            walls = [w for w, _ in free[n]]
            results[f"{config}_{n}_us"] = median(walls)
            results[f"{config}_{n}_min_us"] = min(walls)
            results[f"{config}_{n}_max_us"] = max(walls)
    dist.destroy_process_group()


def launch(world, config, schedule_name, n_rounds, timeout_s):
    """Runs one process per stage; returns (results, finished in time)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        results = manager.dict()
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=worker, args=(r, world, init_file, config, schedule_name,
                                                  n_rounds, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        finished = all(p.exitcode == 0 for p in procs)
        print(f"torch_pipelining: {config} {schedule_name} on {world} processes: "
              f"{'finished' if finished else 'did not finish'}", file=sys.stderr, flush=True)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        return dict(results), finished


KEYS = ("a_cpu_overhead_us", "a_pinned_overhead_us", "d_pipe_us", "d_pipe_min_us", "d_pipe_max_us",
        "d_whole_us", "d_loop_us", "d_one_f_one_b_finished", "d_one_f_one_b_us")


def print_results(out, reason):
    for key in KEYS:
        print(f"{key}={out.get(key, float('nan'))}")
    # The names //benchmarks:distributed_cpu reads: the GPipe step of configuration (d).
    print(f"torch_pipelining_us={out.get('d_pipe_us', float('nan'))}")
    print(f"torch_pipelining_min_us={out.get('d_pipe_min_us', float('nan'))}")
    print(f"torch_pipelining_max_us={out.get('d_pipe_max_us', float('nan'))}")
    if reason:
        print(f"torch_pipelining_reason={reason}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds for each GPipe configuration")
    parser.add_argument("--one-f-one-b-timeout", type=float, default=60.0)
    parser.add_argument("--configs", default="a,d",
                        help="comma-separated GPipe configurations to run, of a and d")
    parser.add_argument("--no-one-f-one-b", action="store_true",
                        help="skip the Schedule1F1B run (reported as nan)")
    parser.add_argument("--retries", type=int, default=0,
                        help="relaunch a GPipe configuration that did not finish, up to N times "
                             "(its GPipe step over Gloo sometimes hangs; see below)")
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in ("a", "d")]
    if unknown or not configs:
        parser.error(f"--configs {args.configs!r}: each configuration must be a or d, "
                     "comma-separated (e.g. --configs d)")
    try:
        import torch.distributed.pipelining  # noqa: F401
    except Exception as e:  # PyTorch < 2.4 has no torch.distributed.pipelining
        print_results({}, f"import torch.distributed.pipelining failed ({type(e).__name__})")
        return 0
    out, reason = {}, ""
    for config, world in (("a", 4), ("d", 2)):
        if config not in configs:
            continue
        for attempt in range(1 + max(0, args.retries)):
            results, finished = launch(world, config, "gpipe", args.rounds,
                                       timeout_s=args.timeout)
            if finished:
                break
            print(f"torch_pipelining: {config}: attempt {attempt + 1} did not finish within "
                  f"{args.timeout:.0f} s", file=sys.stderr, flush=True)
        if finished:
            out.update(results)
        else:
            reason = f"configuration {config}: no result within {args.timeout:.0f} s or a rank failed"
    if not args.no_one_f_one_b:
        results, finished = launch(2, "d", "one_f_one_b", 1,
                                   timeout_s=args.one_f_one_b_timeout)
        out["d_one_f_one_b_finished"] = 1 if finished else 0
        out.update(results)
    print_results(out, reason)
    print(f"torch_version {torch.__version__}")
    print(f"blas {loaded_blas()}")


if __name__ == "__main__":
    sys.exit(main())
