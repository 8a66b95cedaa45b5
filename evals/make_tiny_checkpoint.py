"""Write the tiny random Qwen3 Hugging Face checkpoint of tests/hfmodels (real BPE tokenizer, chat template)
into a folder, for evals/run_lm_eval.sh: `python evals/make_tiny_checkpoint.py FOLDER`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "hfmodels"))

from hf_families import make_family_checkpoint  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_tiny_checkpoint.py FOLDER")
    print(make_family_checkpoint("qwen3", Path(sys.argv[1])))
