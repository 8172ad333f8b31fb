"""The engine: exact detached Jacobians of a transformer's forward pass (torch only).

The façade of the engine layer: runs/, cli/ and users import from here, never from its modules
(tests/test_layering.py). Two engines implement :class:`Engine`: :class:`InMemoryEngine` (a loaded model)
and :class:`StreamedEngine` (one layer in memory at a time); :func:`load_engine` picks one from the user's
options, :func:`as_engine` wraps a loaded model; :func:`prompt_pass` computes every product of one prompt from one
trace, and :func:`jacobian` (the one Jacobian entry point) and :func:`attribution_graph` are its verbs. The folders:
docs/engine.md, "Layout".

>>> from detjac.engine import attribution_graph, load_engine, jacobian
>>> engine = load_engine("default")                                         # doctest: +SKIP
>>> res = jacobian(engine, "Kitten, n. A young")                           # doctest: +SKIP
>>> res.jacobian.shape, res.reconstruction_error                          # doctest: +SKIP
>>> graph = attribution_graph(engine, "The capital of France is")          # doctest: +SKIP
"""

from __future__ import annotations

from detjac.exactness import FLOAT64_EXACTNESS_BOUND, relative_error
from detjac.targets import DEFAULT_ROW_BLOCK, OUTPUTS, Target, layer_targets

from .checkpoints.default import DEFAULT_MODEL_DIR, DEMO_PROMPTS, load_default_model, resolve_model
from .checkpoints.gguf import read_gguf_header
from .checkpoints.hub import hub_cache_dir, is_hub_id
from .checkpoints.loading import check_checkpoint_dir, get_tokenizer, load_model, parse_prompt
from .checkpoints.reference import ModelRef
from .checkpoints.tiny import tiny_model, tiny_model_types
from .deprecated import detached_jacobian, stream_jacobian
from .detach.model import Linearized, linearized
from .families import FAMILIES, family_for, supported_model_types
from .inmemory.inmemory_engine import InMemoryEngine
from .inmemory.rows import JacobianStream
from .interface import Engine
from .kept import KeptEngine
from .memory import honour_cpu_budget, parse_memory, return_freed_memory
from .products.decode import SingularTriplets, decode_blocks, decode_top, dense_svd, final_norm_gain
from .products.lanczos import OperatorSVD, operator_svd
from .products.linear_operator import JacobianOperator, jacobian_operator
from .products.logits import decoding_matrix, logit_jacobian, output_logits
from .prompt_products import BlockSink, PromptProducts, assemble, prompt_pass
from .pullback import PullRequest, Seed, Site
from .result import JacobianResult, reconstruct
from .selection import as_engine, check_layerwise_request, load_engine, load_engine_with
from .streamed.streamed_engine import StreamedEngine, StreamedResult
from .tools.attribution import AttributionGraph, check_graph, logit_attribution, logit_vectors
from .tools.exactness_report import ExactnessReport, exactness_report
from .tools.graph_json import graph_dict, write_graph
from .tools.graph_prune import Pruned, prune
from .tools.head_loadings import HeadLoadings, carried_by_heads, strongest_heads
from .tools.lens_pulls import pull_every_position, pull_final_block
from .tools.neuron_values import batch_neuron_values, prompt_neuron_values, write_effects
from .tools.neurons import neurons, residual_ends
from .tools.qk import QKAttribution, qk_attribution, residual_decomposition, write_qk
from .tools.steer import SteeringOperator, check_method, evaluate, generate
from .tools.triplets import Explanation, explain, explain_summed
from .types import EngineStats, JacobianBlock, Plan, Prompt, Trace
from .verbs import attribution_graph, jacobian

# What a user needs. The other names imported above are what the layers above (runs/, cli/) use, importable
# from here for them and for scripts written against earlier versions.
__all__ = [
    "OUTPUTS",
    "AttributionGraph",
    "Engine",
    "HeadLoadings",
    "InMemoryEngine",
    "JacobianBlock",
    "JacobianResult",
    "StreamedEngine",
    "StreamedResult",
    "Target",
    "PullRequest",
    "QKAttribution",
    "Seed",
    "Site",
    "as_engine",
    "attribution_graph",
    "check_graph",
    "decode_top",
    "dense_svd",
    "exactness_report",
    "explain",
    "family_for",
    "get_tokenizer",
    "jacobian",
    "jacobian_operator",
    "linearized",
    "load_engine",
    "load_model",
    "operator_svd",
    "prompt_pass",
    "qk_attribution",
    "supported_model_types",
    "write_graph",
]

# Names that were renamed: still importable from here, with a DeprecationWarning the first time each is used.
_RENAMED = {"StreamedModel": "StreamedEngine", "RowBlock": "JacobianBlock"}
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
