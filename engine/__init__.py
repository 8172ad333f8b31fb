"""The engine: exact detached Jacobians of a transformer's forward pass (torch only).

The façade of the engine layer: runs/, cli/ and users import from here, never from its modules
(tests/test_layering.py); it holds what they use and nothing else (``__all__``). Two engines implement :class:`Engine`:
:class:`InMemoryEngine` (a loaded model) and :class:`StreamedEngine` (one layer in memory at a time);
:func:`load_engine` picks one from the user's options, :func:`as_engine` wraps a loaded model; :func:`prompt_pass`
computes every product of one prompt from one trace, and :func:`jacobian` (the one Jacobian entry point) is its verb.
Attribution graphs are the layer above (:mod:`detjac.graphs`); what they read of the engine (its pullback sites,
neurons and heads) is exported here. The folders: docs/engine.md, "Layout".

>>> from detjac.engine import load_engine, jacobian
>>> engine = load_engine("default")                                         # doctest: +SKIP
>>> res = jacobian(engine, "Kitten, n. A young")                           # doctest: +SKIP
>>> res.jacobian.shape, res.reconstruction_error                          # doctest: +SKIP
"""

from .checkpoints.default import DEFAULT_MODEL_DIR
from .checkpoints.gguf import read_gguf_header
from .checkpoints.hub import hub_cache_dir
from .checkpoints.loading import get_tokenizer, load_model, parse_prompt
from .checkpoints.reference import ModelRef
from .checkpoints.tiny import tiny_model, tiny_model_types
from .families import FAMILIES
from .inmemory.inmemory_engine import InMemoryEngine
from .interface import Engine
from .memory import device_key, honour_cpu_budget
from .pieces.layer import Attention
from .products.decode import decode_blocks, decode_top
from .products.lanczos import operator_svd
from .products.linear_operator import JacobianOperator, jacobian_operator
from .products.logits import logit_jacobian
from .prompt_products import BlockSink, PromptProducts, Tee, assemble, prompt_pass
from .pullback import EMBEDDINGS, OUTPUT, PullRequest, Seed, Site, input_of, neurons_of
from .result import JacobianResult
from .selection import as_engine, check_layerwise_request, load_engine
from .streamed.streamed_engine import StreamedEngine
from .tools.aside import FrozenValues
from .tools.exactness_report import exactness_report
from .tools.intervene import Edit, intervene
from .tools.lens_pulls import pull_final_block
from .tools.neuron_values import neuron_values, write_effects
from .tools.neurons import activations, check_neurons, neurons, residual_ends
from .tools.qk import check_qk_request, qk_attribution
from .tools.steer import SteeringOperator, evaluate, generate
from .tools.triplets import explain, explain_summed
from .types import JacobianBlock, Trace
from .verbs import ResultSink, jacobian

__all__ = [
    "DEFAULT_MODEL_DIR", "EMBEDDINGS", "FAMILIES", "OUTPUT", "Attention", "BlockSink", "Engine",
    "InMemoryEngine", "JacobianBlock", "JacobianOperator", "JacobianResult", "ModelRef", "PromptProducts",
    "PullRequest", "ResultSink", "Seed", "Site", "SteeringOperator", "StreamedEngine", "Tee", "Trace", "activations",
    "as_engine", "assemble", "check_layerwise_request",
    "check_neurons", "decode_blocks", "decode_top", "device_key", "evaluate", "exactness_report", "explain",
    "explain_summed", "generate", "get_tokenizer",
    "honour_cpu_budget", "hub_cache_dir", "input_of", "jacobian", "jacobian_operator", "load_engine",
    "load_model", "logit_jacobian", "neurons", "neurons_of", "operator_svd", "parse_prompt", "neuron_values",
    "prompt_pass", "pull_final_block", "qk_attribution", "read_gguf_header", "residual_ends",
    "tiny_model", "tiny_model_types", "write_effects", "Edit", "intervene", "FrozenValues",
    "check_qk_request",
]
