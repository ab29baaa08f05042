"""Options of `PagedCache` (`generate(cache_implementation="paged_quant", cache_config={...})`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..caches.uniform import SLIDING_DTYPES
from ..options import CacheOptions, check_bool, check_choice, check_int, check_positive_int

TAIL_DTYPES = ("auto", None, "float32", "float16", "bfloat16")


@dataclass
class PagedOptions(CacheOptions):
    """- page_size: tokens per page; a row's newest `0..page_size - 1` tokens wait, unquantized, in its own tail
    - bits: code width of keys and values (1..8; 2, 4 and 8 unpack by table lookup)
    - group_size: tokens per per-channel key group (must divide page_size) and channels per per-token value group
      (must divide the head dim), as in KIVI
    - share: rows share equal pages (by content, and when a batch operation duplicates a row) with reference
      counts; False: every row holds its own copy of every page (the same values, for comparison)
    - tail_dtype: dtype of the unquantized tail: "auto" (16 bits: the model's dtype if fp16/bf16, else float16),
      None (the model's dtype) or a dtype name
    - sliding_dtype: the uniform format ("int4", "int8", "fp8", ...) of the sliding-window layers (Gemma-3's local
      layers), which keep their newest `sliding_window - 1` tokens per token quantized; "auto": "int4" up to 4
      bits, else "int8"; None: the model's dtype, as transformers keeps them
    """

    page_size: int = 64
    bits: int = 4
    group_size: int = 32
    share: bool = True
    tail_dtype: str | None = "auto"
    sliding_dtype: str | None = "auto"

    def validate(self) -> None:
        check_positive_int("page_size", self.page_size)
        check_int("bits", self.bits, 1, 8)
        check_positive_int("group_size", self.group_size)
        if self.page_size % self.group_size:
            raise ValueError(f"group_size={self.group_size} must divide page_size={self.page_size} (keys are "
                             "quantized per channel over groups of group_size tokens inside a page)")
        check_bool("share", self.share)
        check_choice("tail_dtype", self.tail_dtype, TAIL_DTYPES)
        check_choice("sliding_dtype", self.sliding_dtype, SLIDING_DTYPES)
