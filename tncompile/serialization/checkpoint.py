"""A checkpoint's training state: what ``tncompile.save(..., optimizer=, controller=)`` keeps
beside the model (:func:`training_state`), how a file's copy is checked
(:func:`check_training_state`), and ``tncompile.resume``, which puts it back into a new
optimizer, controller and random streams."""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..result.model_api import is_compressed
from ..runtime.ways import measured
from ..errors import ModelFileError, is_int

__all__ = ["resume", "training_state", "check_training_state", "param_names"]


def training_state(compiled: nn.Module, optimizer: torch.optim.Optimizer | None, controller, extra: Any,
                   rng: bool) -> dict[str, Any] | None:
    """``{"extra", "optimizer", "controller", "rng", "ways"}`` as plain data and tensors (``None``
    when there is nothing to keep); the optimizer's state is keyed by parameter name; with
    ``rng``, ``ways`` holds the measured ways' winners (:mod:`~tncompile.runtime.ways.measured`),
    so a resumed run takes the ways this one took and continues bit for bit."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"tncompile.save: optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__} {optimizer!r}")
    if controller is not None and not (hasattr(controller, "state_dict") and hasattr(controller, "penalty")):
        raise TypeError(f"tncompile.save: controller must be a RankController, got {type(controller).__name__}")
    if optimizer is None and controller is None and extra is None and not rng:
        return None
    state: dict[str, Any] = {"extra": extra, "optimizer": None, "controller": None, "rng": None, "ways": None}
    if optimizer is not None:
        state["optimizer"] = {"class": type(optimizer).__name__, "names": param_names(compiled, optimizer),
                              "state": optimizer.state_dict()}
    if controller is not None:
        state["controller"] = controller.state_dict()
    if rng:
        state["ways"] = measured.snapshot()
        state["rng"] = {"cpu": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}
    return state


def check_training_state(state: Any, where: str, values: bool = False) -> dict[str, Any]:
    """``state``, read back from a file, if it has the shape :func:`training_state` gives
    (the optimizer's state is checked against the parameters by :func:`resume`, the
    controller's by its ``load_state_dict``); else ``ModelFileError``. Its tensors may be
    specs (dtype and shape) or, with ``values``, the tensors, whose random states are then
    checked to be ones a generator takes."""
    if not isinstance(state, dict) or set(state) not in (_KEYS, _KEYS | {"ways"}):
        raise ModelFileError(f"{where}: the training state must hold extra, optimizer, controller, rng and ways")
    try:
        if state.get("ways") is not None:
            measured.check_winners(state["ways"])
    except ValueError as e:
        raise ModelFileError(f"{where}: the measured ways: {e}") from e
    opt = state["optimizer"]
    if opt is not None and not (isinstance(opt, dict) and set(opt) == {"class", "names", "state"}
                                and isinstance(opt["class"], str) and isinstance(opt["state"], dict)
                                and isinstance(opt["names"], list)
                                and all(isinstance(g, list) and all(isinstance(n, str) for n in g)
                                        for g in opt["names"])):
        raise ModelFileError(f"{where}: the optimizer state must hold class, names (a list of lists of parameter "
                             "names) and state")
    rng = state["rng"]
    if rng is not None and not (isinstance(rng, dict) and set(rng) == {"cpu", "cuda"} and _generator_state(rng["cpu"])
                                and (rng["cuda"] is None or isinstance(rng["cuda"], list))):
        raise ModelFileError(f"{where}: the random state must hold a CPU generator's state and a list of CUDA ones")
    extra = state["extra"]
    if extra is not None and not isinstance(extra, dict):
        raise ModelFileError(f"{where}: extra must be a dict")
    streams = (extra or {}).get("rng_per_rank")
    if streams is not None and not (isinstance(streams, list) and all(map(_generator_state, streams))):
        raise ModelFileError(f"{where}: extra['rng_per_rank'] must be a list of CPU generator states")
    if rng is not None and rng["cuda"] is not None and not all(
            getattr(t, "dtype", None) == torch.uint8 and tuple(t.shape) == (16,) for t in rng["cuda"]):
        raise ModelFileError(f"{where}: the CUDA random states must be 16-byte uint8 tensors")
    if values:
        for t in ([rng["cpu"]] if rng is not None else []) + list(streams or []):
            try:
                torch.Generator().set_state(t)
            except RuntimeError as e:
                raise ModelFileError(f"{where}: a saved random state is not one a generator takes ({e})") from e
    return state


_KEYS = {"extra", "optimizer", "controller", "rng"}   # a checkpoint written before "ways" lacks it


def _generator_state(t: Any) -> bool:
    """Whether ``t`` (a tensor or a file's spec of one) has a CPU generator state's dtype and
    shape (what ``torch.set_rng_state`` takes)."""
    return getattr(t, "dtype", None) == torch.uint8 and tuple(getattr(t, "shape", ())) == (_RNG_STATE_BYTES,)


_RNG_STATE_BYTES = torch.get_rng_state().numel()


def param_names(compiled: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Per param group, the names of its parameters in the compiled model."""
    names_ = {id(p): n for n, p in compiled.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names_]
        if missing:
            raise ValueError(f"the optimizer holds parameters that are not the compiled model's "
                             f"(shapes {missing[:3]}); build it from the model being saved")
        out.append([names_[id(p)] for p in group["params"]])
    return out

def resume(compiled: nn.Module, optimizer: torch.optim.Optimizer | None = None, controller=None, *,
           restore_rng: bool = True) -> dict[str, Any]:
    """Restore the training state a checkpoint carried into a loaded model's new optimizer
    and controller; returns the checkpoint's ``extra`` dict.

    Build ``optimizer`` from the loaded model exactly as in the first run (same parameter
    groups, e.g. ``param_groups(compiled, ...)``); the saved state is matched by parameter
    name and a mismatch is an error.

    Example
    -------
    >>> compiled = tncompile.load("ckpt.tnc", model=MyModel())
    >>> opt = torch.optim.AdamW(tncompile.param_groups(compiled, lr=1e-3))
    >>> ctl = tncompile.RankController(compiled, opt, target_ratio=0.01)
    >>> extra = tncompile.resume(compiled, opt, ctl)
    """
    if not is_compressed(compiled):
        raise TypeError(f"tncompile.resume expects the model tncompile.load returned, got {type(compiled).__name__}")
    state = getattr(compiled, "training_state", None)
    if state is None:
        raise ValueError("this model carries no training state: load it with tncompile.load from a file "
                         "written by tncompile.save(..., optimizer=..., controller=...)")
    if optimizer is not None:
        saved = state["optimizer"]
        if saved is None:
            raise ValueError("the checkpoint has no optimizer state (save with optimizer=...)")
        if saved["class"] != type(optimizer).__name__:
            raise ValueError(f"the checkpoint's optimizer is {saved['class']}, got {type(optimizer).__name__}")
        if param_names(compiled, optimizer) != saved["names"]:
            raise ValueError("the optimizer's parameter groups differ from the saved one's; build it "
                             "the same way (same groups, same order) from the loaded model")
        _check_optimizer_state(saved["state"], optimizer)
        try:
            optimizer.load_state_dict(saved["state"])
        except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise ModelFileError(f"the checkpoint's optimizer state does not load into {type(optimizer).__name__} "
                                 f"({type(e).__name__}: {e})") from e
    if controller is not None:
        if state["controller"] is None:
            raise ValueError("the checkpoint has no controller state (save with controller=...)")
        try:
            controller.load_state_dict(state["controller"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ModelFileError(f"the checkpoint's controller state is malformed ({e})") from e
    if restore_rng and state.get("ways"):
        measured.install(state["ways"])   # the ways the saved run took: the same arithmetic from here
    if restore_rng and state["rng"] is not None:
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            try:
                torch.cuda.set_rng_state_all(state["rng"]["cuda"])
            except (RuntimeError, TypeError) as e:  # saved on another GPU count or build
                raise ModelFileError(f"the checkpoint's CUDA random states do not fit this machine ({e})") from e
        per_rank = (state.get("extra") or {}).get("rng_per_rank")
        if per_rank and torch.distributed.is_available() and torch.distributed.is_initialized():
            _restore_rank_stream(per_rank)
    compiled.training_state = None
    return dict(state.get("extra") or {})


#: what torch.optim's optimizers keep per parameter as a scalar; every other tensor has its shape
_SCALAR_STATE = ("step", "mu_product", "eta", "mu")


def _check_optimizer_state(state: Any, optimizer: torch.optim.Optimizer) -> None:
    """A saved ``optimizer.state_dict()`` fits ``optimizer``'s parameter groups: the same
    groups of the same sizes, one state per parameter, and every tensor in a parameter's
    state (of torch.optim's optimizers) a scalar step count or of the parameter's shape. A file whose
    numbers are genuine but whose state is shared or reshaped would resume another run."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not (isinstance(groups, list) and isinstance(state.get("state"), dict) and len(groups) == len(
            optimizer.param_groups) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        raise ModelFileError("the checkpoint's optimizer state is not an optimizer's state_dict of "
                             f"{len(optimizer.param_groups)} parameter group(s)")
    params: dict[Any, torch.Tensor] = {}
    for saved_group, group in zip(groups, optimizer.param_groups):
        if len(saved_group["params"]) != len(group["params"]):
            raise ModelFileError("the checkpoint's optimizer groups differ in size from the optimizer's")
        for index, p in zip(saved_group["params"], group["params"]):
            if not is_int(index) or index in params:
                raise ModelFileError(f"the checkpoint's optimizer state names parameter {index!r:.40} twice or "
                                     "not by number")
            params[index] = p
    own = type(optimizer).__module__.startswith("torch.optim")  # others may keep state of their own shapes
    for index, entry in state["state"].items():
        p = params.get(index)
        if p is None or not isinstance(entry, dict):
            raise ModelFileError(f"the checkpoint's optimizer state holds an entry {index!r:.40} for no parameter")
        for key, value in entry.items():
            scalar = key in _SCALAR_STATE and isinstance(value, torch.Tensor) and value.dim() == 0
            if own and isinstance(value, torch.Tensor) and not scalar and value.shape != p.shape:
                raise ModelFileError(f"the checkpoint's optimizer state {key!r:.40} of parameter {index} is "
                                     f"{tuple(value.shape)}, the parameter {tuple(p.shape)}")


def _restore_rank_stream(per_rank: list[torch.Tensor]) -> None:
    """A distributed run's checkpoint: each process gets its own saved CPU random stream
    back. On another world size, processes the saving run did not have get a stream of
    their own derived from rank 0's and their rank (distinct, reproducible), and every
    process is told the run is no longer bit-identical."""
    me, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if me < len(per_rank):
        torch.set_rng_state(per_rank[me])
    else:
        base = torch.Generator()
        base.set_state(per_rank[0])
        seed = int(torch.randint(0, 2**62, (1,), generator=base)) + me
        torch.manual_seed(seed)
    if world != len(per_rank):
        warnings.warn(f"tncompile.resume: the checkpoint was written by {len(per_rank)} process(es), this run has "
                      f"{world}. Weights, optimizer and controller state resume exactly; what follows is not "
                      "bit-identical to the saved run: each step averages a different number of micro-batches, "
                      "your sampler splits the data differently, and "
                      + ("processes beyond the saved ones draw new random streams (derived from rank 0's)."
                         if world > len(per_rank) else "the streams of the missing processes are dropped."),
                      RuntimeWarning, stacklevel=3)
