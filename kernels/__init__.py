"""Triton kernels, each beside the torch reference it must match (installed as `hf_kvcache.kernels`)."""
