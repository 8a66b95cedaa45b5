"""Scheduler cost on the CPU: decode steps at 256 running requests, and admission of 64 long prompts.

No worker: a stand-in answers every step with fixed token ids, built outside the timed region, so the
figures are the scheduler's own (schedule + update). Goals: a decode step under 200 us, the 64 admissions
(DESIGN 3 lookup, replay plan, block allocation, NewRequest building) under 2 ms.

    python bench/bench_scheduler.py [--steps 2000] [--trials 20]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from raystate.engine_args import EngineArgs, build_engine_config
from raystate.messages import SamplingParams, StepMessage, StepResult, ids_to_bytes
from raystate.scheduler import Scheduler


def fake_result(msg: StepMessage, token: int) -> StepResult:
    """Every row samples `token` (the bench keeps chunks whole, so every row reaches its end)."""
    req_ids = [r.req_id for r in msg.new_requests if r.num_scheduled > 0] + [d.req_id for d in msg.running]
    return StepResult(step_id=msg.step_id, req_ids=req_ids, sampled=ids_to_bytes([token] * len(req_ids)))


def run_to_decode(sched: Scheduler) -> None:
    """Steps until no request is prefilling."""
    while True:
        msgs = sched.schedule()
        msg = msgs[0]
        sched.update(0, fake_result(msg, 7))
        if not msg.new_requests and all(d.num_scheduled == 1 for d in msg.running):
            return


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_decode(num_reqs: int, steps: int) -> None:
    max_len = 64 + steps + 256
    config = build_engine_config(
        EngineArgs(
            max_model_len=max_len,
            block_size=16,
            num_blocks=num_reqs * -(-max_len // 16) + 1,
            max_num_seqs=num_reqs,
            max_num_batched_tokens=8192,
        )
    )
    sched = Scheduler(config)
    for i in range(num_reqs):
        prompt = [(i * 7 + j) % 256 for j in range(64)]
        sched.add_request(f"r{i}", prompt, SamplingParams(max_tokens=steps + 64, ignore_eos=True))
    run_to_decode(sched)
    sched_us, update_us, total_us = [], [], []
    for step in range(steps):
        t0 = time.perf_counter_ns()
        msg = sched.schedule()[0]
        t1 = time.perf_counter_ns()
        result = fake_result(msg, step % 256)
        t2 = time.perf_counter_ns()
        updates = sched.update(0, result)
        t3 = time.perf_counter_ns()
        assert len(updates) == num_reqs
        sched_us.append((t1 - t0) / 1e3)
        update_us.append((t3 - t2) / 1e3)
        total_us.append((t1 - t0 + t3 - t2) / 1e3)
    print(f"decode step, {num_reqs} running, {steps} steps (us): ")
    for name, xs in (("schedule", sched_us), ("update", update_us), ("schedule+update", total_us)):
        print(f"  {name:16s} median {statistics.median(xs):8.1f}   p99 {percentile(xs, 0.99):8.1f}")


def bench_admission(num_prompts: int, prompt_len: int, shared_len: int, trials: int) -> None:
    config = build_engine_config(
        EngineArgs(
            max_model_len=prompt_len + 64,
            block_size=16,
            num_blocks=(num_prompts + 1) * (prompt_len + 64) // 16 + 1,
            max_num_seqs=num_prompts + 1,
            max_num_batched_tokens=num_prompts * prompt_len,
        )
    )
    shared = [(j * 31 + 5) % 256 for j in range(shared_len)]
    prompts = [
        shared + [(i * 13 + j) % 256 for j in range(prompt_len - shared_len)] for i in range(num_prompts)
    ]
    intake_ms, admit_ms = [], []
    for _ in range(trials):
        sched = Scheduler(config)
        sched.add_request("warm", shared + [1, 2, 3], SamplingParams(max_tokens=1))
        sched.update(0, fake_result(sched.schedule()[0], 7))  # computes and caches the shared prefix
        gc.collect()  # the last trial's garbage is not this trial's cost (GC stays on while timing)
        t0 = time.perf_counter_ns()
        for i, prompt in enumerate(prompts):
            sched.add_request(f"p{i}", prompt, SamplingParams(max_tokens=8))
        t1 = time.perf_counter_ns()
        msg = sched.schedule()[0]
        t2 = time.perf_counter_ns()
        assert len(msg.new_requests) == num_prompts
        assert all(r.replay_start > 0 for r in msg.new_requests)
        intake_ms.append((t1 - t0) / 1e6)
        admit_ms.append((t2 - t1) / 1e6)
    stats = sched.stats()
    what = f"{num_prompts} prompts x {prompt_len} tokens, {shared_len} shared"
    print(f"admission of {what} ({trials} trials, ms):")
    print(
        f"  admit (one schedule call)  median {statistics.median(admit_ms):7.3f}   min {min(admit_ms):7.3f}"
    )
    print(
        f"  intake (add_request: validate, hash all full blocks)  median {statistics.median(intake_ms):7.3f}"
        f"   min {min(intake_ms):7.3f}"
    )
    print(
        f"  prefix hit tokens {stats.prefix_hit_tokens}, replayed tokens {stats.replayed_tokens}, "
        f"borrowed (shared replay) {stats.shared_replay_tokens}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    bench_decode(256, args.steps)
    bench_admission(64, 2048, 1024, args.trials)
    bench_admission(32, 8192 + 128, 8192, args.trials)  # bench_prefix's burst


if __name__ == "__main__":
    main()
