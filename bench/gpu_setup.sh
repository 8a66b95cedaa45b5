#!/usr/bin/env bash
# Sourced at the start of every command on the GPU machine (which has torch and triton but no Ray or
# msgspec, and no network): installs the carried wheels from .whl/ (see ../shared/device/make-wheels.sh)
# and this package, editable and without dependencies.
set -e
if [ -d .whl ]; then
  . .whl/install.sh
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/raystate-install.log 2>&1 \
  || { cat /tmp/raystate-install.log; exit 1; }
python3 - <<'PY'
import torch, triton
print(f"[gpu_setup] torch {torch.__version__} triton {triton.__version__} cuda {torch.cuda.is_available()} "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}")
PY
set +e
