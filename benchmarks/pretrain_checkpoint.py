"""Checkpoints of the pretraining study's runs (issue 66): every run can stop anywhere and
continue where it left off, bit for bit in what it computes.

* A compressed run (TT, low-rank) is saved with tncompile's own ``save`` (cores, optimizer
  state by parameter name, rank controller, random streams, measured ways) and restored
  with ``load`` + ``resume``: its shapes change as ranks are cut, which only tncompile's
  file knows how to rebuild.
* A dense or GaLore run is saved as one safetensors file of data: the model's tensors,
  each optimizer state's tensors (GaLore's projection matrices included) and a JSON
  metadata field of numbers (steps) and the run's ``extra`` (its curve). Reading it back is
  bounded, and every tensor is checked against the model it goes into before anything is
  changed.

Both are written atomically (a temporary file renamed over the old one).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import torch

from pretrain_models import ModelShape, Run, build, controller_for, model_for, optimizer_for, variant_kind

#: a plain checkpoint may hold at most this many bytes beyond 4 x the model's
PLAIN_FLOOR_BYTES = 64 << 20
_PROJECTOR_FIELDS = ("rank", "update_proj_gap", "scale", "proj_type")


class CheckpointError(ValueError):
    """A checkpoint file that does not fit the run it is asked to continue."""


def save_run(run: Run, path: Path, extra: dict[str, Any]) -> None:
    """Write ``run`` and ``extra`` (plain data: numbers, strings, lists, dicts) to ``path``."""
    if run.compressed:
        import tncompile
        tncompile.save(run.model, path, optimizer=run.optimizer, controller=run.controller, extra=extra)
        return
    from safetensors.torch import save
    from tncompile.files import write_replacing
    tensors, aliases, seen = {}, {}, {}
    for name, t in run.model.state_dict().items():   # a tied weight is stored once, under its first name
        if t.data_ptr() in seen:
            aliases[name] = seen[t.data_ptr()]
        else:
            seen[t.data_ptr()] = name
            tensors[f"model.{name}"] = t.detach().contiguous()
    scalars: dict[str, dict[str, Any]] = {}
    for index, p in enumerate(_params(run.optimizer)):
        for key, value in run.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"opt.{index}.{key}"] = value.detach().contiguous()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                scalars.setdefault(str(index), {})[key] = value
            elif type(value).__name__ == "GaLoreProjector":
                tensors[f"opt.{index}.{key}.ortho"] = value.ortho_matrix.contiguous()
                scalars.setdefault(str(index), {})[key] = {f: getattr(value, f) for f in _PROJECTOR_FIELDS}
            else:
                raise TypeError(f"optimizer state {key!r} of parameter {index} is a {type(value).__name__}: "
                                "the plain checkpoint keeps tensors, numbers and GaLore projectors only")
    meta = {"variant": run.variant, "aliases": aliases, "scalars": scalars, "extra": extra}
    write_replacing(path, save(tensors, metadata={"run": json.dumps(meta)}))


def load_run(path: Path, variant: str, shape: ModelShape, lr: float, steps: int,
             device: str = "cpu", objective: str = "clm") -> tuple[Run, dict[str, Any]]:
    """``(run, extra)`` continued from the checkpoint at ``path``: the model, optimizer and
    controller ``build(variant, ...)`` would make, holding the saved state."""
    kind, _ = variant_kind(variant)
    if kind in ("tt", "lowrank"):
        import tncompile
        model = tncompile.load(path, model=lambda: model_for(objective, shape, 0, device), map_location=device)
        optimizer = optimizer_for(variant, model, lr)
        controller = controller_for(variant, model, optimizer, steps)
        extra = tncompile.resume(model, optimizer, controller)
        return Run(variant, model, optimizer, controller), extra
    return _load_plain(path, variant, shape, lr, steps, device, objective)


def _load_plain(path: Path, variant: str, shape: ModelShape, lr: float, steps: int,
                device: str, objective: str) -> tuple[Run, dict[str, Any]]:
    from safetensors import SafetensorError
    from safetensors.torch import load
    from tncompile.files import read_bounded
    run = build(variant, shape, lr, seed=0, steps=steps, device=device, objective=objective)
    model_bytes = sum(t.numel() * t.element_size() for t in run.model.state_dict().values())
    try:
        raw = read_bounded(path, 4 * model_bytes + PLAIN_FLOOR_BYTES)
        tensors = load(raw)
        meta = json.loads(_metadata(raw).get("run", "null"))
    except (OSError, ValueError, SafetensorError) as e:   # a JSONDecodeError is a ValueError
        raise CheckpointError(f"{path}: not a readable checkpoint of this study ({e})") from e
    if not isinstance(meta, dict) or meta.get("variant") != variant or not isinstance(meta.get("scalars"), dict) \
            or not isinstance(meta.get("extra"), dict) or not isinstance(meta.get("aliases"), dict):
        raise CheckpointError(f"{path}: its metadata is not a {variant} run's (variant, aliases, scalars, extra)")
    state = run.model.state_dict()
    aliases = meta["aliases"]
    for name, t in state.items():
        saved = tensors.get(f"model.{aliases.get(name, name)}")
        if saved is None or saved.shape != t.shape or saved.dtype != t.dtype:
            raise CheckpointError(f"{path}: model tensor {name} is missing or not {t.dtype} {tuple(t.shape)}")
    params = _params(run.optimizer)
    restored: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        if key.startswith("model."):
            if key[len("model."):] not in state:
                raise CheckpointError(f"{path}: {key} is not a tensor of the model")
            continue
        parts = key.split(".")
        if len(parts) not in (3, 4) or parts[0] != "opt" or not parts[1].isdigit() or int(parts[1]) >= len(params):
            raise CheckpointError(f"{path}: {key!r} is not an optimizer state of one of {len(params)} parameters")
        p = params[int(parts[1])]
        if not t.is_floating_point() or t.dim() > p.dim() or any(n > max(p.shape) for n in t.shape):
            raise CheckpointError(f"{path}: {key} ({t.dtype} {tuple(t.shape)}) cannot be the optimizer state of "
                                  f"a parameter of shape {tuple(p.shape)}")
        restored.setdefault(int(parts[1]), {})[".".join(parts[2:])] = t
    for index, fields in meta["scalars"].items():
        if not index.isdigit() or int(index) >= len(params) or not isinstance(fields, dict):
            raise CheckpointError(f"{path}: optimizer scalars for {index!r}, not one of {len(params)} parameters")
        for key, value in fields.items():
            ortho = restored.get(int(index), {}).pop(f"{key}.ortho", None)
            if isinstance(value, dict):
                restored.setdefault(int(index), {})[key] = _projector(value, ortho, path)
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                restored.setdefault(int(index), {})[key] = value
            else:
                raise CheckpointError(f"{path}: optimizer scalar {key!r} of parameter {index} is not a finite number")
    if any(key.endswith(".ortho") for fields in restored.values() for key in fields):
        raise CheckpointError(f"{path}: a projection matrix without its projector's settings")
    with torch.no_grad():
        for name, t in state.items():
            t.copy_(tensors[f"model.{aliases.get(name, name)}"])
    for index, fields in restored.items():
        run.optimizer.state[params[index]] = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                                              for k, v in fields.items()}
    return run, meta["extra"]


def _projector(fields: dict[str, Any], ortho: torch.Tensor | None, path: Path):
    from galore_torch.galore_projector import GaLoreProjector
    checks: dict[str, Callable[[Any], bool]] = {
        "rank": lambda v: type(v) is int and v > 0, "update_proj_gap": lambda v: type(v) is int and v > 0,
        "scale": lambda v: isinstance(v, (int, float)) and math.isfinite(v), "proj_type": lambda v: v == "std"}
    if set(fields) != set(_PROJECTOR_FIELDS) or not all(checks[k](fields[k]) for k in checks) or ortho is None:
        raise CheckpointError(f"{path}: a GaLore projector's settings are not {_PROJECTOR_FIELDS} with a matrix")
    projector = GaLoreProjector(fields["rank"], update_proj_gap=fields["update_proj_gap"], scale=fields["scale"],
                                proj_type=fields["proj_type"])
    projector.ortho_matrix = ortho
    return projector


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _metadata(raw: bytes) -> dict[str, str]:
    """The safetensors header's ``__metadata__`` (bounded by the file's own header length)."""
    length = int.from_bytes(raw[:8], "little")
    if not 0 < length <= len(raw) - 8:
        raise ValueError("the header length is outside the file")
    header = json.loads(raw[8:8 + length])
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("the metadata is not a map of strings")
    return meta
