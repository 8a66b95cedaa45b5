"""Import direction (LAYOUT.md): each layer, imported alone in a fresh interpreter, pulls in only what it may.

`config`, `kv_layout`, `engine_args`, `messages`, `errors` stay on the standard library and msgspec; the
scheduler and the serving layer never load torch or triton (the serving layer imports the engine only
inside the replica, through its client factory); the kernels never load Ray; the worker and the model
never load the scheduler or Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "ray")

CASES = {
    "wire types and config": (
        ["raystate.config", "raystate.kv_layout", "raystate.engine_args", "raystate.messages"]
        + ["raystate.errors", "raystate.tokenizer"],
        [*HEAVY, "numpy"],
    ),
    "package root": (["raystate"], HEAVY),
    "scheduler": (
        ["raystate.scheduler", "raystate.scheduler.scheduler", "raystate.scheduler.router"],
        HEAVY,
    ),
    "client": (["raystate.client"], ["torch", "triton", "raystate.engine", "raystate.worker"]),
    "serve": (
        [
            "raystate.serve",
            "raystate.serve.protocol",
            "raystate.serve.server",
            "raystate.serve.ingress",
            "raystate.serve.app",
        ],
        ["torch", "triton", "raystate.worker", "raystate.model", "raystate.engine", "raystate.launch"],
    ),
    "kernels": (["raystate.kernels"], ["ray", "raystate.scheduler", "raystate.worker", "raystate.model"]),
    "model": (["raystate.model"], ["ray", "raystate.scheduler", "raystate.worker"]),
    "worker": (["raystate.worker.worker"], ["ray", "raystate.scheduler"]),
}


def _loaded_after_import(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_imports_stay_in_their_lane(case):
    modules, forbidden = CASES[case]
    loaded = _loaded_after_import(modules)
    leaked = sorted(m for m in loaded for f in forbidden if m == f or m.startswith(f + "."))
    assert not leaked, f"importing {modules} loaded {leaked[:10]}"
