"""The sampling guard's device cost (issue 13): `greedy_checked` (one `max` reduction that yields the
argmax and flags non-finite rows, plus a `where`) against the plain `argmax` it replaced, on logits of
[batch, vocab] fp32, each timed as a CUDA graph of 100 calls (the decode step runs it inside its graph).

    python bench/bench_sampling_guard.py [--batch 1 64 256] [--vocab 259 32000 151936]
"""

from __future__ import annotations

import argparse

import torch

from raystate.worker.sampler import greedy_checked


def graph_time_us(fn, reps: int = 100, iters: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--vocab", type=int, nargs="+", default=[259, 32000, 151936])
    args = ap.parse_args()
    print("batch | vocab | argmax us | greedy_checked us | ratio")
    for b in args.batch:
        for v in args.vocab:
            logits = torch.randn(b, v, device="cuda")
            out = torch.empty(b, dtype=torch.int64, device="cuda")
            assert torch.equal(greedy_checked(logits), logits.argmax(-1))
            plain = graph_time_us(lambda logits=logits, out=out: torch.argmax(logits, dim=-1, out=out))
            guarded = graph_time_us(lambda logits=logits, out=out: out.copy_(greedy_checked(logits)))
            print(f"{b} | {v} | {plain:.2f} | {guarded:.2f} | {guarded / plain:.2f}")


if __name__ == "__main__":
    main()
