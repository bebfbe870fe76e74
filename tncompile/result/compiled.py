"""``CompiledModel``: the trainable result of ``tncompile.compile``."""
from __future__ import annotations

import copy
import functools
import inspect

from torch import fx, nn

from ..ir.program import Program, module_at
from .model_api import CompressedModelAPI
from ..runtime.layers.factor_links import link_factor_groups
from ..runtime.fused.graph_functions import keep_functions_when_pickled
from ..runtime.layers import TNModule, TTMTiedLinear
from ..runtime.kernels.denormals import call_flushing

__all__ = ["CompiledModel"]


class CompiledModel(CompressedModelAPI, nn.Module):
    """A compiled model: call it like the original, train it like any module.

    Attributes
    ----------
    model : torch.fx.GraphModule
        The rewritten graph (its parameters are the compiled model's).
    program : Program
        The IR, with pass history and notes.
    """

    def __init__(self, program: Program):
        super().__init__()
        self.model = program.graph_module
        self._program = program
        self.training = program.graph_module.training
        # layers of one layout merge their factors together; each forward starts afresh
        self.__dict__["_factor_peers"] = link_factor_groups(self.model)
        self._show_signature()

    def _show_signature(self) -> None:
        """``forward`` as ``inspect``, ``torch.export`` (``dynamic_shapes``) and HF ``Trainer``
        see it: the traced model's own parameters, names and defaults (an fx trace keeps
        them; after a ``torch.export`` trace the graph takes the example inputs' flat
        structure and ``forward`` stays ``(*args, **kwargs)``). Made per instance, again
        after unpickling or copying."""
        forward = functools.partial(CompiledModel.forward, self)
        if self._program.inputs.frontend != "export":
            forward.__signature__ = inspect.signature(self.model.forward)
        self.__dict__["forward"] = forward

    @property
    def program(self) -> Program:
        return self._program

    def __getstate__(self) -> dict:
        keep_functions_when_pickled(self.model)  # the graph module is pickled before the program
        state = dict(super().__getstate__())
        state.pop("forward", None)  # bound to this instance: made again by __setstate__
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._show_signature()

    def forward(self, *args, **kwargs):
        peers = self.__dict__.get("_factor_peers")
        if peers is not None:
            peers.forget()
        args, kwargs = self._program.inputs.bind(args, kwargs)
        try:
            return call_flushing(self.model, self.model, *args, **kwargs)
        except TypeError as e:  # only now look at why: no cost on calls that fit
            _explain_call(self.model, args, kwargs, e)
            raise

    def get_submodule(self, target: str) -> nn.Module:
        """``nn.Module.get_submodule``, also by the original model's names:
        ``compiled.get_submodule("layers.0.ff1")`` is ``compiled.model.layers[0].ff1``."""
        try:
            return super().get_submodule(target)
        except AttributeError:
            return self.model.get_submodule(target)

    def to_dense(self) -> fx.GraphModule:
        """A plain module with every network multiplied back into a dense layer.

        Tied heads stay tied to the rebuilt embedding, and a table looked up
        from several places stays one table. The result takes the
        same inputs as the compiled model (after a ``torch.export`` trace:
        inputs fixed at trace time, such as ``use_cache=False``, may be left
        out, by a forward pre-hook that binds them).
        """
        gm = copy.deepcopy(self.model)
        dense: dict[int, nn.Module] = {}
        targets = [n.target for n in gm.graph.nodes if n.op in ("call_module", "get_attr")]
        tn = {t: m for t in dict.fromkeys(targets) if isinstance(m := module_at(gm, t), TNModule)}
        for t, m in tn.items():
            if not isinstance(m, TTMTiedLinear):  # a table looked up from two places stays one table
                if id(m) not in dense:
                    dense[id(m)] = m.to_dense_module()
                gm.set_submodule(t, dense[id(m)])
        for t, m in tn.items():
            if isinstance(m, TTMTiedLinear):
                gm.set_submodule(t, m.to_dense_head(dense.get(id(m.embedding))))
        gm.recompile()
        if self._program.inputs.frontend == "export":
            spec = self._program.inputs
            gm.register_forward_pre_hook(lambda _, args, kwargs: spec.bind(args, kwargs), with_kwargs=True)
        return gm

    def extra_repr(self) -> str:
        return f"ratio={self.ratio:.4f}, frontend={self._program.inputs.frontend}"


def _explain_call(model: fx.GraphModule, args: tuple, kwargs: dict, error: TypeError) -> None:
    """Raise a ``TypeError`` naming the compiled model's inputs when ``error``
    came from a call that does not fit them (not from inside the model)."""
    signature = inspect.signature(model.forward)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as mismatch:
        raise TypeError(f"the compiled {model.__class__.__name__} takes {signature} (the traced model's "
                        f"inputs): {mismatch}") from error
