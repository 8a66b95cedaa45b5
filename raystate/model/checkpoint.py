"""Loading a Hugging Face safetensors checkpoint into a model's (possibly fused) parameters.

Our model fuses projections that HF checkpoints keep apart (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`), so the caller does not hand over a state dict: it maps each checkpoint tensor name to a
`WeightTarget`, a parameter plus the first row the tensor fills. The loader then works in two passes:

1. Headers only. Every file's header gives each tensor's name, shape and dtype without reading data, so
   missing, unexpected and mis-shaped tensors, and fused parameters whose pieces overlap or leave rows
   unwritten, are all found (and reported together) before a single byte is copied. A failed load never
   leaves a model half-overwritten.
2. Data. Each file is memory-mapped (`safe_open`) straight onto the targets' device and each tensor is
   read once and copied into its rows, then dropped, so the host holds about one tensor at a time rather
   than a second copy of the checkpoint.

torch and safetensors only: no Ray, no scheduler.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from raystate.errors import InvalidRequest

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Problems listed by name in one error message; the rest are counted.
_MAX_LISTED = 10


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not fit the targets (missing, unexpected or mis-shaped tensors, or
    fused parameters whose rows would overlap or stay unwritten). Raised before anything is copied; the
    message lists every problem found (each kind truncated to a few names)."""


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: rows [row_offset, row_offset + its dim 0) of `param` (the whole
    param when the shapes match and row_offset is 0).

    `param_name` only labels the parameter in error messages (e.g. "layers.0.attn.qkv_proj.weight");
    without it a parameter is named by the checkpoint tensors that fill it.
    """

    param: torch.Tensor  # the destination (a model parameter, already on its device and in its dtype)
    row_offset: int = 0
    param_name: str = ""


@dataclass(frozen=True)
class LoadStats:
    """What a load did, for benchmarks and logs."""

    tensors: int  # checkpoint tensors copied
    bytes_read: int  # their size in the checkpoint's own dtypes
    seconds: float  # wall time of the whole load, header checks included
    missing_optional: tuple[str, ...] = ()  # `optional` names the checkpoint lacks (the caller fills them)

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class _Header:
    """One checkpoint tensor as its file's header describes it."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name, e.g. "BF16"


def _capped(items: Iterable[str], sep: str = ", ") -> str:
    """Up to _MAX_LISTED items, then a count of the rest: one message stays readable however many
    tensors are wrong."""
    items = list(items)
    shown = sep.join(items[:_MAX_LISTED])
    if len(items) > _MAX_LISTED:
        shown += f"{sep}... ({len(items) - _MAX_LISTED} more)"
    return shown


def _listed(names: Iterable[str]) -> str:
    """Quoted names, capped."""
    return _capped(repr(n) for n in names)


def checkpoint_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards listed in model.safetensors.index.json
    (weight_map), or the single model.safetensors (or, failing that, every *.safetensors). No file: an
    InvalidRequest naming the folder.

    The index wins over a stray model.safetensors beside it, because HF writes the index exactly when it
    shards; a shard the index names but the folder lacks is an error naming that file (a partial download
    would otherwise surface later as a confusing "missing tensor").
    """
    root = Path(folder)
    if not root.is_dir():
        raise InvalidRequest("checkpoint folder", "an existing directory", str(root))
    index = root / INDEX_FILE
    if index.is_file():
        shards = sorted(set(_weight_map(index).values()))
        absent = [name for name in shards if not (root / name).is_file()]
        if absent:
            raise InvalidRequest(
                "checkpoint shard",
                f"present in {root} (listed in {INDEX_FILE}; {len(absent)} missing: {_listed(absent)})",
                absent[0],
            )
        return [root / name for name in shards]
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if not files:
        raise InvalidRequest(
            "checkpoint folder", f"a folder holding {SINGLE_FILE}, {INDEX_FILE} or *.safetensors", str(root)
        )
    return files


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> shard file name."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise InvalidRequest(str(index), "JSON with a 'weight_map' object", f"unreadable ({e})") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InvalidRequest(f"{index} weight_map", "an object of tensor name -> file name", weight_map)
    return weight_map


def _read_headers(folder: Path, files: list[Path]) -> dict[str, _Header]:
    """Every tensor's file, shape and dtype, from the file headers alone (no tensor data is read).

    The headers are the truth; when an index exists, each name it maps must be in the file it names.
    """
    headers: dict[str, _Header] = {}
    duplicated: list[str] = []
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                if name in headers:
                    duplicated.append(f"{name} (in {headers[name].file.name} and {path.name})")
                    continue
                view = f.get_slice(name)
                headers[name] = _Header(path, tuple(view.get_shape()), view.get_dtype())
    problems = []
    if duplicated:
        problems.append(f"tensors stored in two files: {_listed(duplicated)}")
    index = folder / INDEX_FILE
    if index.is_file():
        misplaced = [
            f"{name} -> {file}"
            for name, file in _weight_map(index).items()
            if name not in headers or headers[name].file.name != file
        ]
        if misplaced:
            problems.append(f"{INDEX_FILE} maps tensors to files that do not hold them: {_listed(misplaced)}")
    if problems:
        raise CheckpointMismatch(f"checkpoint {folder}: " + "; ".join(problems))
    return headers


def _rows(t: torch.Size | tuple[int, ...]) -> int:
    """Rows a tensor spans along dim 0; a 0-dim tensor counts as one row (copied whole)."""
    return t[0] if len(t) else 1


def _param_key(param: torch.Tensor) -> tuple:
    """Identifies one destination across targets even when the caller passes fresh views of it (`p.data`):
    same memory, shape and strides. Empty tensors have no memory to compare, so fall back to identity."""
    if param.numel() == 0:
        return ("id", id(param))
    return (param.device, param.data_ptr(), tuple(param.shape), param.stride())


def _shape_problem(name: str, target: WeightTarget, shape: tuple[int, ...], fused: bool) -> str | None:
    """Why checkpoint tensor `name` of `shape` cannot fill its target, or None when it fits."""
    pshape = tuple(target.param.shape)
    off = target.row_offset
    if len(pshape) == 0:
        if shape == () and off == 0:
            return None
        return f"{name!r}: expected shape () (a scalar param), checkpoint has {shape}"
    fits = (
        len(shape) == len(pshape)
        and shape[1:] == pshape[1:]
        and off + shape[0] <= pshape[0]
        # A lone target at row 0 is a plain weight: it must match whole (else "rows unwritten" would hide
        # a plain shape mismatch).
        and (fused or off != 0 or shape[0] == pshape[0])
    )
    if fits:
        return None
    if not fused and off == 0:
        return f"{name!r}: expected shape {pshape}, checkpoint has {shape}"
    room = max(pshape[0] - off, 0)
    return (
        f"{name!r}: expected shape (n, {', '.join(map(str, pshape[1:]))}) with n <= {room} "
        f"(rows {off}.. of param shape {pshape}), checkpoint has {shape}"
    )


def _coverage_problems(
    groups: dict[tuple, list[tuple[str, WeightTarget]]], headers: dict[str, _Header], skipped: set[str]
) -> list[str]:
    """Overlapping or unwritten rows of each destination: every row must be written exactly once.

    A destination with a piece in `skipped` (an optional tensor the checkpoint lacks) is only checked for
    overlaps: the caller fills the rest itself.
    """
    problems = []
    for pieces in groups.values():
        param = pieces[0][1].param
        label = next((t.param_name for _, t in pieces if t.param_name), "")
        label = repr(label) if label else f"the param filled by {_listed(n for n, _ in pieces)}"
        spans = sorted(
            (t.row_offset, t.row_offset + _rows(headers[n].shape), n) for n, t in pieces if n not in skipped
        )
        end, last = 0, None
        gaps = []
        for start, stop, name in spans:
            if start < end:
                problems.append(f"{label}: {name!r} (rows [{start}, {stop})) overlaps {last!r}")
            elif start > end:
                gaps.append(f"[{end}, {start})")
            if stop > end:
                end, last = stop, name
        if end < _rows(param.shape):
            gaps.append(f"[{end}, {_rows(param.shape)})")
        if gaps and not any(n in skipped for n, _ in pieces):
            problems.append(f"{label} (shape {tuple(param.shape)}): rows {', '.join(gaps)} not written")
    return problems


def _targets_device(targets: dict[str, WeightTarget]) -> torch.device:
    """The one device every destination is on (the files are opened straight onto it)."""
    devices = {t.param.device for t in targets.values()}
    if len(devices) > 1:
        raise InvalidRequest("targets", "params on one device", sorted(str(d) for d in devices))
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "meta":
        raise InvalidRequest("targets", "materialised params (not on the meta device)", str(device))
    return device


def _check(
    folder: Path,
    headers: dict[str, _Header],
    targets: dict[str, WeightTarget],
    ignore: Callable[[str], bool],
    optional: frozenset[str],
) -> set[str]:
    """Every name/shape/coverage problem at once, as one CheckpointMismatch; else the skipped optional
    names."""
    missing = sorted(n for n in targets if n not in headers and n not in optional)
    skipped = {n for n in targets if n not in headers and n in optional}
    unexpected = sorted(n for n in headers if n not in targets and not ignore(n))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_listed(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) (not in targets): {_listed(unexpected)}")

    groups: dict[tuple, list[tuple[str, WeightTarget]]] = {}
    for name, target in targets.items():
        if not isinstance(target.row_offset, int) or target.row_offset < 0:
            problems.append(f"{name!r}: row_offset must be an int >= 0, got {target.row_offset!r}")
            continue
        groups.setdefault(_param_key(target.param), []).append((name, target))
    bad_shapes = []
    for pieces in groups.values():
        fused = len(pieces) > 1
        for name, target in pieces:
            if name in headers:
                problem = _shape_problem(name, target, headers[name].shape, fused)
                if problem:
                    bad_shapes.append(problem)
    if bad_shapes:
        problems.append(f"{len(bad_shapes)} shape mismatch(es): {_capped(bad_shapes, '; ')}")
    if not problems:
        # Row spans need every tensor present (or skipped) and fitting, so this runs only on sound input.
        coverage = _coverage_problems(groups, headers, skipped)
        if coverage:
            problems.append(f"{len(coverage)} row coverage problem(s): {_capped(coverage, '; ')}")
    if problems:
        raise CheckpointMismatch(f"checkpoint {folder} does not fit the targets:\n- " + "\n- ".join(problems))
    return skipped


@torch.no_grad()
def load_checkpoint(
    folder: str | os.PathLike,
    targets: dict[str, WeightTarget],
    *,
    ignore: Callable[[str], bool] = lambda name: False,
    optional: frozenset[str] = frozenset(),
) -> LoadStats:
    """Copies every checkpoint tensor named in `targets` into its target, converting to the param's dtype.

    `ignore(name)` says which checkpoint tensors the model has no use for (e.g. rotary caches); any other
    tensor not in `targets` is an error, so a renamed or forgotten weight cannot load silently. Names in
    `optional` may be absent from the checkpoint (e.g. lm_head.weight of a tied-embedding model): their
    rows are left as they are and the names come back in `LoadStats.missing_optional` for the caller to
    fill. Every problem is found from the headers and raised (CheckpointMismatch) before any copy.
    """
    start = time.perf_counter()
    root = Path(folder)
    files = checkpoint_files(root)
    device = _targets_device(targets)
    headers = _read_headers(root, files)
    skipped = _check(root, headers, targets, ignore, optional)

    copied = 0
    nbytes = 0
    if device.type == "cuda":
        stager = _PinnedStager(device)
        for path in files:
            n_tensors, n_bytes = stager.load_file(path, targets)
            copied += n_tensors
            nbytes += n_bytes
        files = []  # done
    for path in files:
        with safe_open(path, framework="pt", device=str(device)) as f:
            # File order, so the memory-mapped reads walk each file front to back.
            order = f.offset_keys() if hasattr(f, "offset_keys") else f.keys()
            for name in order:
                target = targets.get(name)
                if target is None:
                    continue
                tensor = f.get_tensor(name)  # checkpoint dtype, on `device`, shape as in the header
                nbytes += tensor.numel() * tensor.element_size()
                param = target.param
                dest = param if param.dim() == 0 else param.narrow(0, target.row_offset, tensor.shape[0])
                dest.copy_(tensor.to(device=param.device, dtype=param.dtype))
                del tensor
                copied += 1
    return LoadStats(
        tensors=copied,
        bytes_read=nbytes,
        seconds=time.perf_counter() - start,
        missing_optional=tuple(sorted(skipped)),
    )


# safetensors' dtype names -> torch dtypes (the ones checkpoints of our families carry).
_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _PinnedStager:
    """Host -> GPU copies of a memory-mapped safetensors file through two pinned buffers.

    `safe_open(..., device="cuda")` reads each tensor into pageable host memory and copies it from there,
    which the driver stages synchronously: about half the rate of reading the file. Here each tensor's
    bytes go from the page cache (the mapping) into one pinned buffer while the GPU copies the other one
    (`non_blocking`), so reading the file and the host-to-device copies overlap; the dtype conversion then
    runs on the GPU. Large tensors (an embedding) go through in chunks.
    """

    CHUNK = 128 << 20  # bytes per pinned buffer

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers = [torch.empty(self.CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def _to_device(self, src: torch.Tensor) -> torch.Tensor:  # uint8 [n] on the host -> uint8 [n] on the GPU
        out = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
        for start in range(0, src.numel(), self.CHUNK):
            piece = src[start : start + self.CHUNK]
            buf, event = self.buffers[self.turn], self.events[self.turn]
            if event is not None:
                event.synchronize()  # the GPU has finished reading this buffer's last chunk
            buf[: piece.numel()].copy_(piece)
            out[start : start + piece.numel()].copy_(buf[: piece.numel()], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.events[self.turn] = event
            self.turn ^= 1
        return out

    def load_file(self, path: Path, targets: dict[str, WeightTarget]) -> tuple[int, int]:
        """Copies the file's tensors that `targets` names into them; returns (tensors, bytes)."""
        import mmap
        import struct
        import warnings

        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
            base = 8 + header_len
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # writable view, never written
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = torch.frombuffer(mapped, dtype=torch.uint8)  # uint8 [file bytes], no copy
        entries = sorted(
            ((name, meta) for name, meta in header.items() if name != "__metadata__" and name in targets),
            key=lambda item: item[1]["data_offsets"][0],
        )
        copied = nbytes = 0
        for name, meta in entries:
            begin, end = meta["data_offsets"]
            dtype = _ST_DTYPES.get(meta["dtype"])
            if dtype is None:
                raise InvalidRequest(f"{path.name}: {name}", f"one of {sorted(_ST_DTYPES)}", meta["dtype"])
            on_device = self._to_device(data[base + begin : base + end])
            tensor = on_device.view(dtype).view(meta["shape"])
            target = targets[name]
            param = target.param
            dest = param if param.dim() == 0 else param.narrow(0, target.row_offset, tensor.shape[0])
            dest.copy_(tensor)
            copied += 1
            nbytes += end - begin
        torch.cuda.current_stream(self.device).synchronize()
        del data
        mapped.close()
        return copied, nbytes
