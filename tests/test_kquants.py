"""ggml's 5-bit and K-quant blocks: pockjax's dequantization equals the gguf package's reference, bit for bit."""

import gguf
import numpy as np
import pytest

from pockjax.io.gguf import write_gguf
from pockjax.io.kquants import BLOCKS, DEQUANTIZERS
from pockjax.models.llama.gguf import SUPPORTED_QUANT_TYPES, dequantize

# byte offsets of each type's float16 scales (random bytes there could be NaN or inf)
_F16_AT = {"Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2],
           "Q6_K": [208]}


def _blocks(name, n=48, seed=0):
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, BLOCKS[name][1]), dtype=np.uint8)
    for at in _F16_AT[name]:
        b[:, at:at + 2] = rng.normal(size=(n, 1)).astype(np.float16).view(np.uint8).reshape(n, 2)
    return b


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_dequantize_equals_gguf_reference(name):
    b = _blocks(name)
    ref = gguf.quants.dequantize(b.reshape(-1), gguf.GGMLQuantizationType[name]).reshape(len(b), -1)
    np.testing.assert_array_equal(DEQUANTIZERS[name](b), ref)
    assert name in SUPPORTED_QUANT_TYPES


def test_a_k_quant_tensor_reads_from_a_file(tmp_path):
    from pockjax.io.gguf import open_gguf

    b = _blocks("Q4_K", n=6)  # a (3, 512) matrix: two blocks per row
    path = str(tmp_path / "k.gguf")
    write_gguf(path, {"general.architecture": "llama"}, [("w", "Q4_K", (3, 512), b)])
    f = open_gguf(path)
    t = f.tensors[0]
    assert (t.type_name, t.shape) == ("Q4_K", (3, 512))
    ref = gguf.quants.dequantize(b.reshape(-1), gguf.GGMLQuantizationType.Q4_K).reshape(3, 512)
    np.testing.assert_array_equal(dequantize(f.tensor_bytes(t), "Q4_K", (3, 512)), ref)
