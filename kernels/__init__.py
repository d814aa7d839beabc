"""Triton kernels, one file per op (installed as `dflash_fast.kernels`).

Each file holds the Triton kernels, plain host functions `<op>_forward` /
`<op>_backward`, and one `torch.autograd.Function` that only calls them.
Importing this package does not import Triton; `dflash_fast.drafter.ops` imports an op
file only when the Triton backend is selected.
"""
