"""The MoK CUDA kernels as ``torch.library`` custom ops (namespace ``mok``).

Each kernel family has one module: it declares the C signatures it calls
(:mod:`megatron_mok.ops.library` loads ``libmegatron_mok.so``), registers the op with a fake
(shape-only) implementation so ``torch.compile`` and CUDA graphs see through it, and offers a
plain-tensor convenience wrapper. Importing this package loads nothing; the library is
loaded at the first kernel call.
"""
