"""GGUF blocks decoded in torch (detjac.engine.checkpoints.gguf_blocks) equal the gguf package's numpy decoder bit
for bit, on random blocks of every type and on the tensors of the two real GGUF files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from real_models import gemma3_path, smollm2_path

from detjac.engine.checkpoints.gguf_blocks import BLOCK_TYPES, check_block_type, dequantize
from detjac.errors import CheckpointError

# where each type keeps its float16 scales (byte offsets): random bytes there could be NaN or infinite
HALF_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,), "F16": (0,)}


def random_blocks(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, block bytes) random bytes of type ``name`` with finite scales (and finite values for the float types)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    assert (block, size) == (BLOCK_TYPES[name].block, BLOCK_TYPES[name].nbytes)
    if name in ("F32", "BF16"):
        values = rng.standard_normal(n).astype(np.float32)
        if name == "F32":
            return values.view(np.uint8).reshape(n, 4)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, 2)
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in HALF_AT[name]:
        scale = (rng.standard_normal(n) * 0.05).astype(np.float16)
        raw[:, at:at + 2] = scale.view(np.uint8).reshape(n, 2)
    return raw


@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
def test_every_block_type_equals_the_gguf_package_bit_for_bit(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    raw = random_blocks(name, 64, rng)
    block = BLOCK_TYPES[name].block
    want = np.asarray(gguf_dequantize(raw, GGMLQuantizationType[name]), dtype=np.float32).reshape(-1)
    got = dequantize(torch.from_numpy(raw.reshape(-1).copy()), name, (2, 32 * block))
    assert got.dtype == torch.float32 and got.shape == (2, 32 * block)
    assert np.array_equal(got.reshape(-1).numpy().view(np.uint32), want.view(np.uint32))


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    return [smollm2_path(), gemma3_path(tmp_path_factory.mktemp("gemma3"))]


def test_the_tensors_of_the_real_files_equal_the_gguf_package(gguf_models):
    from gguf import GGUFReader

    seen = set()
    for path in gguf_models:
        for t in GGUFReader(path).tensors:
            name = t.tensor_type.name
            if name in seen or t.n_elements > 3_000_000:
                continue
            seen.add(name)
            raw = np.asarray(t.data).view(np.uint8)
            want = np.asarray(gguf_dequantize(raw, t.tensor_type), dtype=np.float32).reshape(-1)
            got = dequantize(torch.from_numpy(raw.reshape(-1).copy()), name, (int(t.n_elements),))
            assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32)), (path.name, t.name)
    assert {"Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K", "F32"} <= seen


def test_an_unknown_type_and_a_wrong_byte_count_are_refused():
    with pytest.raises(CheckpointError, match=r"Expected a GGUF block type detjac decodes \(F32, .*\)\. Got IQ2_XXS\."):
        check_block_type("IQ2_XXS")
    with pytest.raises(CheckpointError, match=r"Expected 18 bytes of whole Q4_0 blocks of 32 values for shape \(32,\)"
                                              r"\. Got 17 bytes\."):
        dequantize(torch.zeros(17, dtype=torch.uint8), "Q4_0", (32,))
    with pytest.raises(CheckpointError, match="blocks of 32 values for shape \\(2, 16\\)"):
        dequantize(torch.zeros(18, dtype=torch.uint8), "Q4_0", (2, 16))
    with pytest.raises(CheckpointError, match="as uint8. Got torch.int8"):
        dequantize(torch.zeros(18, dtype=torch.int8), "Q4_0", (32,))
