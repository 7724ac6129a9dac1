"""Native kernels built on first use with the machine's C compiler (docs/mxfp4.md).

`mxfp4` holds the MXFP4 matrix-vector product and dequantisation the packed experts run on, each
with a PyTorch fallback where no compiler is found. `bf16` (a few bf16 rows, AVX-512 BF16 CPUs) and
`rows` (a few fp32 rows, AVX2 or AVX-512: docs/model.md#the-compiled-decode-step) serve the compiled
decode step's products; where they are not built, the step keeps F.linear. `blocks` is the
compiled step's attention over the engine's block tables, read in place (where it is not built, the
layer gathers the blocks and calls `masked_decode`). `prefill` (AVX-512 CPUs) is the attention of a
prompt over dense keys; where it is not built, `blocks.attend` keeps PyTorch's fused flash kernel.
`moe` (AVX-512 CPUs) runs the routed experts of a batched decode step grouped by expert; where it is
not built, the step keeps its gathered reduction. `vec.h` holds what the C sources share.
"""
