#!/usr/bin/env python3
"""One entry point for a fresh machine: `python3 dev.py run` and `python3 dev.py test`.

`run` with no arguments starts the OpenAI-compatible server on the built-in tiny model (a local Ray on
this machine's CPU); `run ARGS` runs `raystate ARGS`. `test` runs ruff, then the whole pytest suite;
`test --fast` leaves out the tests marked `slow` (those that start a Ray cluster or a Serve app, or run
a whole benchmark). Both create (or refresh) the local virtual environment `.venv` first, so the
README's two commands are the whole set-up. On a machine without CUDA the CPU build of torch is
installed (`torch==2.13.0`; a plain `torch` would pull a CUDA build of several GB).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
CPU_TORCH = "torch==2.13.0"
STAMP = VENV / ".raystate-deps"


def _has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None and os.environ.get("RAYSTATE_CPU_ONLY") != "1"


def _deps_key() -> str:
    """Changes whenever pyproject.toml or the torch choice changes, so the venv is refreshed then."""
    h = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    h.update(b"cuda" if _has_cuda() else b"cpu")
    return h.hexdigest()


def ensure_venv() -> None:
    pip_check = [str(PY), "-m", "pip", "--version"]
    has_pip = PY.exists() and subprocess.call(pip_check, stdout=subprocess.DEVNULL) == 0
    if not has_pip:  # missing, or left half-made by an interrupted run
        print(f"[dev] creating {VENV}", flush=True)
        subprocess.check_call([sys.executable, "-m", "venv", "--clear", str(VENV)])
    if STAMP.exists() and STAMP.read_text() == _deps_key():
        return
    pip = [str(PY), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.check_call([*pip, "--upgrade", "pip", "setuptools", "wheel"])
    if not _has_cuda():
        # The CPU wheel first: the project's own `torch>=...` is then already satisfied.
        subprocess.check_call([*pip, CPU_TORCH])
    subprocess.check_call([*pip, "-e", f"{ROOT}[serve,test,bench]"])
    STAMP.write_text(_deps_key())


def run(cmd: list[str], env: dict[str, str] | None = None) -> int:
    print("[dev] $ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "test"):
        usage = "usage: python3 dev.py run [raystate args...] | test [--fast] [pytest args...]"
        print(usage, file=sys.stderr)
        return 2
    ensure_venv()
    bin_dir = VENV / "bin"
    if argv[0] == "run":
        args = argv[1:] or ["serve", "--model", "tiny"]
        cmd = [str(bin_dir / "raystate"), *args]
        print("[dev] $ " + " ".join(cmd), flush=True)
        # Replace this process, so Ctrl-C and SIGTERM reach the server itself and it shuts down cleanly.
        os.chdir(ROOT)
        os.execv(cmd[0], cmd)
    env = dict(os.environ)
    if not _has_cuda():
        # Triton kernels run through Triton's interpreter on the CPU.
        env.setdefault("TRITON_INTERPRET", "1")
    for cmd in (
        [str(bin_dir / "ruff"), "check", "."],
        [str(bin_dir / "ruff"), "format", "--check", "."],
    ):
        rc = run(cmd, env)
        if rc:
            return rc
    pytest_args = argv[1:]
    if "--fast" in pytest_args:
        pytest_args = [a for a in pytest_args if a != "--fast"] + ["-m", "not slow"]
    # -P: the repo root is not put on sys.path, so a top-level `import kernels` finds Hugging Face's
    # `kernels` package (transformers imports it when installed), not our kernels/ folder, which is
    # imported only as raystate.kernels.
    return run([str(PY), "-P", "-m", "pytest", "-q", *pytest_args], env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
