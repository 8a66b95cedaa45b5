"""What the decode graph's logprobs cost at a real vocabulary, piece by piece, side by side in one process.

    python bench/bench_logprobs.py [--rows 64] [--vocab 262144] [--iters 50]

`raystate.worker.logprobs.compute_logprobs` (what the logprobs graph variants run: the chunked one-pass
kernel `raystate.kernels.logprob_stats`) against the torch formula it replaced (a log_softmax of every
row, then a gather, a compare-and-count and a topk of the log-probabilities), and the torch pieces alone. Each
is captured in a CUDA graph and replayed (as the decode step runs it); microseconds per call, and the
share of the copy bandwidth for one read of the fp32 [rows, vocab] block.
"""

from __future__ import annotations

import argparse

import torch

from raystate.kernels.logprob_stats import logprob_stats
from raystate.messages import MAX_LOGPROBS
from raystate.worker.logprobs import compute_logprobs


def one_pass(logits: torch.Tensor, tok: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The formula before the chunked reductions: log_softmax, gather, count, topk."""
    lp = torch.log_softmax(logits, dim=-1)
    tok_lp = lp.gather(1, tok.unsqueeze(1))
    rank = (lp > tok_lp).sum(dim=1, keepdim=True) + 1
    return tok_lp, rank, *torch.topk(lp, MAX_LOGPROBS, dim=-1)


def time_graph(fn, iters: int) -> float:
    """Microseconds per replay of fn captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, device=dev, generator=gen) * 4  # fp32 [N, V]
    tok = torch.randint(0, args.vocab, (args.rows,), device=dev, generator=gen)
    src = torch.empty(args.rows, args.vocab, device=dev, dtype=torch.float32)
    src.copy_(logits)
    # A copy of the block (one read + one write) gives the bandwidth this run is measured against.
    copy_us = time_graph(lambda: src.copy_(logits), args.iters)
    read_us = copy_us / 2
    cases = {
        "compute_logprobs (logprob_stats: one pass)": lambda: compute_logprobs(logits, tok),
        "logprob_stats alone": lambda: logprob_stats(logits, tok, MAX_LOGPROBS),
        "one pass: log_softmax + gather + count + topk": lambda: one_pass(logits, tok),
        "log_softmax alone": lambda: torch.log_softmax(logits, dim=-1),
        "logsumexp, whole rows": lambda: torch.logsumexp(logits, dim=1, keepdim=True),
        "topk 20, whole rows": lambda: torch.topk(logits, MAX_LOGPROBS, dim=1),
        "rank: compare and count": lambda: (logits > logits[:, :1]).sum(dim=1),
        "rank: count_nonzero": lambda: torch.count_nonzero(logits > logits[:, :1], dim=1),
        "rank: int32 sum": lambda: (logits > logits[:, :1]).sum(dim=1, dtype=torch.int32),
        "rank: fp32 sum of the compare": lambda: (logits > logits[:, :1]).float().sum(dim=1),
        "topk 20 unsorted, whole rows": lambda: torch.topk(logits, MAX_LOGPROBS, dim=1, sorted=False),
        "topk 20, rows of 32768": lambda: torch.topk(logits.view(-1, 32768), MAX_LOGPROBS, dim=1),
        "max (argmax) alone": lambda: torch.max(logits, dim=1),
        "amax alone": lambda: torch.amax(logits, dim=1),
    }
    print(
        f"{torch.cuda.get_device_name()}: rows {args.rows}, vocab {args.vocab} (fp32 block "
        f"{args.rows * args.vocab * 4 / 1e6:.0f} MB; one read {read_us:.1f} us at the copy bandwidth)"
    )
    for name, fn in cases.items():
        us = time_graph(fn, args.iters)
        print(f"  {name:48s} {us:8.1f} us  ({read_us / us:.2f} of one read's time)")


if __name__ == "__main__":
    main()
