"""Kernel providers: PyTorch-native fused ops, adapt's own Triton kernels, Liger-Kernel (optional)."""
