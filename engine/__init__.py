"""The engine: exact detached Jacobians of a transformer's forward pass (torch only).

>>> from detjac.engine import load_model, detached_jacobian
>>> model = load_model("path/to/checkpoint", dtype=torch.float64)        # doctest: +SKIP
>>> res = detached_jacobian(model, "The bridge out of Marin is the")     # doctest: +SKIP
>>> res.jacobian.shape, res.reconstruction_error                         # doctest: +SKIP
"""

from .families import FAMILIES, family_for, supported_model_types
from .jacobian import (
    JacobianResult,
    JacobianStream,
    RowBlock,
    decoding_matrix,
    detached_jacobian,
    logit_jacobian,
    output_logits,
    reconstruct,
    relative_error,
    stream_jacobian,
)
from .linearize import Linearized, linearized
from .loading import check_checkpoint_dir, get_tokenizer, load_model, parse_prompt

__all__ = [
    "FAMILIES",
    "JacobianResult",
    "JacobianStream",
    "Linearized",
    "RowBlock",
    "check_checkpoint_dir",
    "decoding_matrix",
    "detached_jacobian",
    "family_for",
    "get_tokenizer",
    "linearized",
    "load_model",
    "logit_jacobian",
    "output_logits",
    "parse_prompt",
    "reconstruct",
    "relative_error",
    "stream_jacobian",
    "supported_model_types",
]
