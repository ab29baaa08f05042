"""A quantized cache format defined here, registered with one `register_cache` call (no library file touched), keeps
the whole cache contract of `test_contract.py` (beam search, reorder / select / repeat / reset, crop, left padding);
its options join the options contract of `tests/core/test_options.py` by being a `CacheOptions`.

The format: 6-bit symmetric codes per token (one code per byte, to keep it short) with a float32 scale per token and
KV head. It is a `quant.rows.TokenFormat` (`quantize`, `dequantize`, `rows`, `reads_in_place`), so the library's
`CodedLayer` stores it; the cache is a `CompressedCache` naming its options and that layer.
"""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import test_contract as contract
from hf_kvcache.caches.base import CompressedCache
from hf_kvcache.caches.coded import CodedLayer
from hf_kvcache.options import CacheOptions, check_number
from hf_kvcache.quant.rows import TokenRows
from hf_kvcache.registry import _FACTORIES, register_cache
from test_contract import ids_of, one_thread  # noqa: F401 (the contract's fixtures)

NAME = "int6-test"
QMAX = 31  # codes -31..31 stored as 0..62


@dataclass
class Int6Codes(TokenRows):
    codes: torch.Tensor  # uint8 [b, h, t, d]
    scale: torch.Tensor  # float32 [b, h, t, 1]
    n: int

    def row_fields(self) -> dict[str, int]:
        return {"codes": 1, "scale": 1}

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale]


@dataclass
class Int6Options(CacheOptions):
    reads_in_place: ClassVar[bool] = False
    min_scale: float = 1e-8

    def validate(self) -> None:
        check_number("min_scale", self.min_scale, lo=0.0, lo_open=True)

    def quantize(self, x: torch.Tensor) -> Int6Codes:
        scale = (x.float().abs().amax(-1, keepdim=True) / QMAX).clamp_min(self.min_scale)
        codes = (torch.round(x.float() / scale).clamp(-QMAX, QMAX) + QMAX).to(torch.uint8)
        return Int6Codes(codes, scale, x.shape[-1])

    def dequantize(self, q: Int6Codes, dtype: torch.dtype) -> torch.Tensor:
        return ((q.codes.float() - QMAX) * q.scale).to(dtype)

    def rows(self, codes, scale, zero, n) -> Int6Codes:
        return Int6Codes(codes, scale, n)


class Int6Cache(CompressedCache):
    options_class = Int6Options
    layer_class = CodedLayer


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_cache(NAME, Int6Cache)
    contract.CASES[NAME] = {}
    yield
    _FACTORIES.pop(NAME)
    contract.CASES.pop(NAME)
    contract._PREFILLED.pop(NAME, None)


CONTRACT = [
    lambda model, ids: contract.test_beam_search_scores_equal_a_replay_of_each_beam(model, ids, NAME, None),
    lambda model, ids: contract.test_reorder_select_repeat_reset_equal_their_definitions(model, ids, NAME),
    lambda model, ids: contract.test_crop_equals_a_cache_that_never_saw_the_cropped_tokens(model, ids, NAME),
    lambda model, ids: contract.test_left_padded_batch_rows_equal_each_prompt_alone(model, ids, NAME),
]


@pytest.mark.slow
@pytest.mark.parametrize("check", CONTRACT, ids=["beam_search", "reorder_select_repeat_reset", "crop", "left_padding"])
def test_contract(smol, ids_of, check):
    with torch.no_grad():
        check(smol, ids_of)


def test_format_round_trip_and_bytes():
    """Codes within half a step of the input, and the bytes a layer holds are exactly its codes and scales."""
    x = torch.randn(2, 3, 10, 64, generator=torch.Generator().manual_seed(0))
    fmt = Int6Options()
    q = fmt.quantize(x)
    err = (fmt.dequantize(q, torch.float32) - x).abs()
    assert bool((err <= q.scale / 2 + 1e-6).all())
    layer = CodedLayer(fmt)
    layer.update(x, x)
    assert layer.tokens_held() == 10 and layer.nbytes() == 2 * (2 * 3 * 10 * 64 + 2 * 3 * 10 * 4)
    restored = CodedLayer(fmt)
    restored.lazy_initialization(x[:, :, :0], x[:, :, :0])
    restored.load_state_tensors(layer.state_tensors())
    restored.cumulative_length = layer.cumulative_length
    assert all(torch.equal(a, b) for a, b in zip(restored.materialize(), layer.materialize()))
    assert dataclasses.replace(q, codes=q.codes[:, :, :4]).tokens == 4
