"""raystate.hf stays off torch and transformers: the serving layer may import it."""

from __future__ import annotations

import subprocess
import sys


def test_hf_package_loads_neither_torch_nor_transformers():
    code = (
        "import sys, raystate.hf, raystate.hf.detokenize, raystate.hf.generation_config\n"
        "print(sorted(m for m in ('torch', 'transformers', 'triton', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
