"""Native kernels built on first use with the machine's C compiler (docs/mxfp4.md).

`mxfp4` holds the MXFP4 matrix-vector product and dequantisation the packed experts run on, each
with a PyTorch fallback where no compiler is found.
"""
