"""Pure-torch reference quantizers: bit packing and group-wise integer / fp8 codecs."""

from .packing import pack_bits, packed_length, unpack_bits
from .uniform import QuantizedTensor, dequantize, quantize

__all__ = ["pack_bits", "unpack_bits", "packed_length", "QuantizedTensor", "quantize", "dequantize"]
