"""Plots for BENCHMARKS.md of the issue "GPU, second round", items 2 and 3, from the H200 results in
bench/results (no GPU needed):

- split_kv_h200.png: decode attention at batch 1 and 8 as a share of the copy bandwidth: one program per
  (row, kv head), the first split-KV policy (two launches, 2026-12-03), and the split kernel of
  2026-12-04, with the goals and what a plain read of the same bytes reaches;
- cold_start_h200.png: `LLM(...)` to its first token by phase, and `raystate serve` to its first healthy
  /health, with the 30 s goal.

    python bench/plot_gpu_items.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GOALS = {"B=1 ctx=8192 W=0": 0.5, "B=8 ctx=8192 W=0": 0.75}


def _rows(path: Path) -> dict[str, dict]:
    return {row["case"]: row for row in json.loads(path.read_text())["split_decode"]}


def plot_split(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    after_doc = json.loads((RESULTS / "attention_split_h200.json").read_text())
    after = {row["case"]: row for row in after_doc["split_decode"]}
    before = _rows(RESULTS / "attention_split_before_h200.json")
    floors = {row["case"]: row for row in after_doc.get("floors", [])}
    cases = [c for c in after if c in before]
    series = [
        ("one program per (row, kv head)", lambda c: after[c]["current of_hbm"], "#bbbbbb"),
        ("split-KV, first policy (2026-12-03)", lambda c: before[c]["policy of_hbm"], "#8fb3d9"),
        ("split-KV, this kernel (2026-12-04)", lambda c: after[c]["policy of_hbm"], "#1f5fa8"),
    ]
    fig, ax = plt.subplots(figsize=(10, 4.6))
    width = 0.26
    for i, (label, value, color) in enumerate(series):
        xs = [k + (i - 1) * width for k in range(len(cases))]
        ax.bar(xs, [value(c) for c in cases], width, label=label, color=color)
    for k, case in enumerate(cases):
        if case in GOALS:
            ax.hlines(GOALS[case], k - 1.5 * width, k + 1.5 * width, colors="#c0392b", linewidth=2)
            ax.text(
                k + 1.55 * width, GOALS[case], f"goal {GOALS[case]}", color="#c0392b", va="center", fontsize=8
            )
    b1 = cases.index("B=1 ctx=8192 W=0") if "B=1 ctx=8192 W=0" in cases else None
    if b1 is not None:
        for name, style in (("read over 256 programs", ":"), ("read over 1024 programs", "--")):
            if name in floors:
                share = floors[name]["of_hbm"]
                ax.hlines(
                    share, b1 - 1.5 * width, b1 + 1.5 * width, colors="black", linestyles=style, linewidth=1
                )
                ax.text(
                    b1 - 1.5 * width,
                    share + 0.005,
                    f"plain {name}: {share:.2f}",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(
        range(len(cases)), [c.replace(" ctx=", "\n").replace(" W=", ", W=") for c in cases], fontsize=8
    )
    ax.set_ylabel("share of copy bandwidth (KV read per call)")
    ax.set_title("Decode attention, bench heads (16 q / 4 kv of 128), bf16, per call in a CUDA graph, H200")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _healthy(log: str, index: int = 0) -> float:
    found = re.findall(r'"healthy_s": ([0-9.]+)', (RESULTS / log).read_text())
    return float(found[index])


def plot_cold_start(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = json.loads((RESULTS / "cold_start_h200.json").read_text())
    phases = ["import", "ray", "weights", "buffers", "kv_cache", "cuda_graphs", "engine", "first_token"]
    colors = ["#999999", "#e67e22", "#27ae60", "#16a085", "#2c3e50", "#8e44ad", "#2980b9", "#c0392b"]
    serve = [
        ("warm Triton cache", _healthy("serve_run_h200_httptools.log")),
        ("warm (2 replicas)", _healthy("serve_run_h200_2replicas.log", 1)),
        ("partly warm (2 replicas)", _healthy("serve_run_h200_2replicas.log", 0)),
        ("cold (1 replica)", _healthy("serve_run_h200_warmup.log")),
        ("cold (2 replicas)", _healthy("serve_run_h200_2replicas_warmup.log")),
    ]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"{r['backend']}, {r['cache']}" for r in runs]
    starts = [0.0] * len(runs)
    for phase, color in zip(phases, colors, strict=True):
        widths = [r["phases"].get(phase, 0.0) for r in runs]
        left.barh(labels, widths, left=starts, color=color, label=phase.replace("_", " "))
        starts = [s + w for s, w in zip(starts, widths, strict=True)]
    left.set_xlabel("seconds")
    left.set_title("LLM(model='bench', device='cuda') to its first token", fontsize=10)
    left.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    right.barh([name for name, _ in serve], [s for _, s in serve], color="#1f5fa8")
    right.axvline(30, color="#c0392b", linewidth=2)
    right.text(30.5, len(serve) - 0.6, "goal: 30 s (warm)", color="#c0392b", fontsize=8)
    right.set_xlabel("seconds")
    right.set_title("raystate serve to its first healthy /health", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    plot_split(RESULTS / "split_kv_h200.png")
    plot_cold_start(RESULTS / "cold_start_h200.png")
    print(f"wrote {RESULTS / 'split_kv_h200.png'} and {RESULTS / 'cold_start_h200.png'}")


if __name__ == "__main__":
    main()
