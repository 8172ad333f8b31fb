"""The engine: exact detached Jacobians of a transformer's forward pass (torch only).

This module is the engine's façade: runs/, cli/ and every other caller import from here
only. Two engines implement one interface (:class:`Engine`, see :mod:`detjac.engine.interface`):
the in-memory one for a loaded model of any supported family, and the layer-streamed one
(:class:`StreamedEngine`) for models larger than the compute device, layerwise targets and
memory budgets. :func:`load_engine` picks one from the user's options; :func:`as_engine` wraps
a loaded model.

>>> from detjac.engine import load_model, detached_jacobian
>>> model = load_model("path/to/checkpoint", dtype=torch.float64)        # doctest: +SKIP
>>> res = detached_jacobian(model, "The bridge out of Marin is the")     # doctest: +SKIP
>>> res.jacobian.shape, res.reconstruction_error                         # doctest: +SKIP

>>> engine = load_engine("path/to/checkpoint", streamed=True, max_memory="cuda:0=8GiB")  # doctest: +SKIP
>>> trace = engine.trace("The bridge out of Marin is the")                               # doctest: +SKIP
>>> for block in engine.blocks(trace, [Target.parse("layer.3", engine.n_layers)]): ...   # doctest: +SKIP
"""

from __future__ import annotations

from detjac.exactness import FLOAT64_EXACTNESS_BOUND, relative_error
from detjac.targets import OUTPUTS, Target, layer_targets

from .checkpoints.loading import check_checkpoint_dir, get_tokenizer, load_model, parse_prompt
from .detach.model import Linearized, linearized
from .families import FAMILIES, family_for, supported_model_types
from .inmemory.inmemory_engine import InMemoryEngine
from .inmemory.rows import JacobianResult, JacobianStream, RowBlock, detached_jacobian, reconstruct, stream_jacobian
from .interface import Engine, EngineStats, JacobianBlock, Plan, Prompt, Trace
from .memory import honour_cpu_budget, parse_memory, return_freed_memory
from .products.decode import SingularTriplets, decode_blocks, decode_top, dense_svd, final_norm_gain
from .products.lanczos import OperatorSVD, operator_svd
from .products.linear_operator import JacobianOperator, jacobian_operator
from .products.logits import decoding_matrix, logit_jacobian, output_logits
from .selection import as_engine, check_layerwise_request, load_engine
from .streamed.streamed_engine import StreamedEngine, StreamedResult

# Names that were renamed: still importable from here, with a DeprecationWarning the first time each is used.
_RENAMED = {"StreamedModel": "StreamedEngine"}
_warned: set[str] = set()


def __getattr__(name: str) -> object:
    if name in _RENAMED:
        new = _RENAMED[name]
        if name not in _warned:
            _warned.add(name)
            import warnings

            warnings.warn(f"detjac.engine.{name} is now {new}; the old name will be removed.", DeprecationWarning,
                          stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module 'detjac.engine' has no attribute {name!r}")


__all__ = [
    "FAMILIES",
    "FLOAT64_EXACTNESS_BOUND",
    "OUTPUTS",
    "Engine",
    "EngineStats",
    "InMemoryEngine",
    "JacobianBlock",
    "JacobianOperator",
    "JacobianResult",
    "JacobianStream",
    "Linearized",
    "OperatorSVD",
    "Plan",
    "Prompt",
    "RowBlock",
    "SingularTriplets",
    "StreamedEngine",
    "StreamedResult",
    "Target",
    "Trace",
    "as_engine",
    "check_checkpoint_dir",
    "check_layerwise_request",
    "decode_blocks",
    "decode_top",
    "decoding_matrix",
    "dense_svd",
    "detached_jacobian",
    "family_for",
    "final_norm_gain",
    "get_tokenizer",
    "honour_cpu_budget",
    "jacobian_operator",
    "layer_targets",
    "linearized",
    "load_engine",
    "load_model",
    "logit_jacobian",
    "operator_svd",
    "output_logits",
    "parse_memory",
    "parse_prompt",
    "reconstruct",
    "relative_error",
    "return_freed_memory",
    "stream_jacobian",
    "supported_model_types",
]
