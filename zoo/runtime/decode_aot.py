"""The decode step compiled ahead of time (AOTInductor): a token costs the step's kernels and not Python.

``torch.compile``'s step still passes through Python each token (the compiled region's entry, its cache lookup,
the AOT dispatcher's wrappers: ~0.2 ms a token, measured on zoo-tiny-moe, whose whole token takes ~1.4 ms).
Here the same step (the model's own forward for one token with a static cache; the zoo's kernels inside as
opaque ops) is exported with ``torch.export`` and compiled by ``torch._inductor.aoti_compile_and_package`` into a
shared library that one C++ call runs. The weights are not copied into it: the library reads the model's own
tensors (``load_constants(..., user_managed=True)``). The cache's tensors are inputs the step updates in place,
so the eager prefill fills the same cache. One library serves one (batch, cache length, dtype); a different one
compiles anew (as the JIT step recompiles), and a changed model needs a new library (``AotStep.of`` keeps one per
model and shape, keyed on the storage of the parameters and of the modules' ``working_copies()``: swapped or
converted weights rebuild it; a refusal is kept on the same key).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import weakref

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from zoo.runtime.attention import attention
from zoo.runtime.realize_query import RealizeOneRowBmmInputs


class NotExportable(RuntimeError):
    """The model's decode step cannot be exported (the reason is ``torch.export``'s or AOTInductor's)."""


@dataclasses.dataclass
class _Refused:
    """Why a model's step was not exported, for the weights and dtype it had then."""
    reason: str
    _key: tuple
    dtype: torch.dtype


class _Step(torch.nn.Module):
    """One decode step with the cache's tensors as inputs: ``(token [B, 1], keys, values, lengths, ...)``."""

    def __init__(self, model, cache: StaticCache):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, input_ids, cache_position, *state):
        for i, layer in enumerate(self.cache.layers):
            layer.keys, layer.values, layer.cumulative_length = state[3 * i: 3 * i + 3]
        return self.model(input_ids=input_ids, past_key_values=self.cache, cache_position=cache_position,
                          use_cache=True, logits_to_keep=1).logits


def cache_state(cache: StaticCache) -> list[torch.Tensor]:
    """The tensors of a static cache the step reads and updates, in its input order."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]


# the step's attention: plain matmul/softmax, which inductor fuses, instead of the SDPA kernel, whose call for one
# query costs more than the arithmetic (zoo-tiny-moe, bf16, 4 runs each: 1.03-1.16 -> 0.97-1.00 ms a token; the 304M
# model 12.5-14.4 -> 12.3-13.8 ms, within noise). The eager prefill keeps the model's own implementation.
STEP_ATTENTION = "eager"

_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(batch, cache length): AotStep}


def _working_copies(model) -> list:
    """(module, name, tensor) for the working copies modules keep outside their state (``working_copies()``: 2/3-bit
    experts' int4 stacks)."""
    return [(m, name, t) for m in model.modules() if hasattr(m, "working_copies")
            for name, t in m.working_copies().items()]


def _weights_key(model) -> tuple:
    return tuple((t.data_ptr(), t.dtype) for t in [*model.parameters(), *(t for *_, t in _working_copies(model))])


@contextlib.contextmanager
def _working_copies_as_buffers(model):
    """The modules' working copies registered as (non-persistent) buffers while the step is exported: the program
    then names them by module path, as it names the weights, and the library is handed them like the weights (a
    tensor outside the state would be a lifted constant, which AOTInductor renames)."""
    added = []
    try:
        for m, name, t in _working_copies(model):
            m.register_buffer(name, t, persistent=False)
            added.append((m, name))
        yield
    finally:
        for m, name in added:
            del m._buffers[name]


class AotStep:
    """A decode step compiled ahead of time for ``model``: ``step(token, position, cache) -> logits [B, 1, V]``."""

    def __init__(self, model, batch: int, max_cache_len: int):
        self.batch, self.max_cache_len, self.dtype = batch, max_cache_len, model.dtype
        cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        token = torch.zeros(batch, 1, dtype=torch.long)
        if any(type(layer) is not StaticLayer for layer in cache.layers):
            kinds = sorted({type(layer).__name__ for layer in cache.layers} - {"StaticLayer"})
            raise NotExportable(f"its cache has {kinds} layers, whose update branches on the position")
        with torch.no_grad():  # one eager call initialises the cache's tensors (their shapes are static)
            model(input_ids=token, past_key_values=cache, cache_position=torch.tensor([0]), use_cache=True)
            self._key = _weights_key(model)  # after the call, which builds any working copy the step reads
            try:
                with attention(model, STEP_ATTENTION), _working_copies_as_buffers(model):
                    program = torch.export.export(_Step(model, cache), (token, torch.tensor([0]),
                                                                        *cache_state(cache)), strict=False)
            except Exception as exc:  # what export cannot trace: the JIT step (which may break the graph) serves
                raise NotExportable(f"torch.export: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}")
        # tensors the step reads that are neither parameters nor buffers (a cached tensor of a module that does not
        # list it in working_copies()) are renamed by AOTInductor, so the library could not be handed them
        lifted = program.graph_signature.lifted_tensor_constants
        if lifted:
            raise NotExportable(f"the step reads {len(lifted)} tensors that are not the model's parameters or buffers "
                                f"(first {lifted[0]})")
        options = {"aot_inductor.package_constants_in_so": False,
                   "post_grad_fusion_options": {"decompose_mm_pass": {}},
                   "post_grad_custom_post_pass": RealizeOneRowBmmInputs()}
        with tempfile.TemporaryDirectory(prefix="zoo-aot-") as folder:  # the library is loaded, then not needed
            path = torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(folder, "step.pt2"),
                                                            inductor_configs=options)
            self.runner = torch._inductor.aoti_load_package(path)
        # the library reads the model's own tensors (no copy): the exported program names them by module path
        named = {**program.state_dict, **program.constants}
        missing = [k for k in self.runner.get_constant_fqns() if k not in named]
        if missing:
            raise NotExportable(f"the compiled step names {len(missing)} tensors the model does not "
                                f"(first {missing[0]})")
        self.runner.load_constants({k: named[k] for k in self.runner.get_constant_fqns()}, check_full_update=True,
                                   user_managed=True)
        self._keep = named  # the library holds pointers to these

    @classmethod
    def of(cls, model, batch: int, max_cache_len: int) -> AotStep:
        """The model's step for this batch and cache length, built on first use and kept on the model."""
        steps = _STEPS.setdefault(model, {})
        step = steps.get((batch, max_cache_len))
        if step is None or step._key != _weights_key(model) or step.dtype != model.dtype:
            try:
                step = steps[(batch, max_cache_len)] = cls(model, batch, max_cache_len)
            except NotExportable as exc:  # kept too: a refused model is not exported again on every call (seconds)
                steps[(batch, max_cache_len)] = _Refused(str(exc), _weights_key(model), model.dtype)
                raise
        if isinstance(step, _Refused):
            raise NotExportable(step.reason)
        return step

    def __call__(self, token: torch.Tensor, position: int, cache: StaticCache) -> torch.Tensor:
        return self.runner(token, torch.tensor([position]), *cache_state(cache))
