"""Small stores with planted structure, whose analyses have known answers (no model, no torch)."""

from __future__ import annotations

import numpy as np

from detjac.store import LayerwiseSpec, create_store, open_store

VOCAB, D, N = 50, 12, 3
P0, P1 = "0" * 15 + "0", "0" * 15 + "1"  # the planted prompts' ids (16 hex digits)


def _matrices(rng):
    """Embedding and unembedding with unit rows (so ``M @ M[t]`` peaks at ``t``), and a final norm gain."""
    embed = rng.standard_normal((VOCAB, D))
    embed /= np.linalg.norm(embed, axis=1, keepdims=True)
    lens = rng.standard_normal((VOCAB, D))
    lens /= np.linalg.norm(lens, axis=1, keepdims=True)
    gain = rng.uniform(0.5, 2, D)
    return embed, lens, gain


def planted_store(path, *, left: int = 31, right: int = 17, layer_from: int = 2, detach: bool = True,
                  prompts: tuple[str, ...] = ("planted",), sigma: float = 50.0):
    """Prompts whose Jacobian is ``sigma u v^T`` at token 1 plus noise, with ``u`` decoding to ``left`` through
    the unembedding and ``v`` to ``right`` through the embedding; layerwise targets layer.0..3 (``u`` planted
    from ``layer_from`` on, through the lens ``W_U diag(g)``) and mlp_local.1. Prompt ids: P0, P1, ... (the
    index in 16 hex digits)."""
    rng = np.random.default_rng(1)
    embed, lens, gain = _matrices(rng)
    unembed = lens / gain
    u_out = unembed[left] / np.linalg.norm(unembed[left])  # decodes to `left` through the unembedding
    specs = {f"layer.{i}": LayerwiseSpec(i, "layer", False) for i in range(4)}
    specs["mlp_local.1"] = LayerwiseSpec(1, "mlp", True)
    run = {"model_id": "planted", "dtype": "float64", "keep": "full", "detach": detach}
    data = lambda: ({"embedding": embed, "unembedding": unembed, "final_norm": gain}, {})  # noqa: E731
    with create_store(path, run, model_data=data) as st:
        for i, text in enumerate(prompts):
            x = rng.standard_normal((N, D))
            x[1] = embed[right]
            with st.begin(f"{i:016x}", n_rows=D, n_tokens=N, n_cols=D, dtype="float64", row_block=D,
                          layerwise=specs) as w:
                J = 0.01 * rng.standard_normal((D, N, D))
                J[:, 1, :] += sigma * np.outer(u_out, embed[right])
                w.write_rows(0, D, J)
                for name, spec in specs.items():
                    Jl = 0.01 * rng.standard_normal((D, N, D))
                    if spec.layer >= layer_from and not spec.local:
                        Jl[:, 1, :] += sigma * np.outer(lens[left], x[1])
                    w.write_block(name, 0, D, 0, N, Jl)
                    inputs = rng.standard_normal((N, D)) if spec.local else x
                    if spec.local:
                        w.write_layerwise(name, "inputs", inputs)
                    w.write_layerwise(name, "output", np.einsum("rtc,tc->r", Jl, inputs))
                w.write_array("embeddings", x)
                w.write_array("output", np.einsum("rtc,tc->r", J, x))
                w.write_array("token_ids", np.array([3, right, 5]))
                w.commit({"prompt": text, "n_tokens": N, "reconstruction_error": 1e-15 if detach else 0.3,
                          "dtype": "float64", "next_token_id": left, "next_token": str(left),
                          "tokens": ["a", "b", "c"]})
    return open_store(path)
