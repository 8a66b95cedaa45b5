"""The scheduler stays pure Python: importing it must not pull in torch, triton or ray."""

import subprocess
import sys


def test_scheduler_imports_no_torch_triton_or_ray():
    code = (
        "import sys, raystate.scheduler, raystate.scheduler.scheduler, raystate.scheduler.router;"
        "print(','.join(sorted(m for m in ('torch', 'triton', 'ray') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
