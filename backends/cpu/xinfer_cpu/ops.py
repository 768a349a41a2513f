"""The CPU backend computes with the plain-torch reference, and packed weights through torch's
weight-only int4/int8 matmuls (:mod:`xinfer_cpu.quant`)."""

from xinfer.torch_ops import TorchOps
from xinfer_cpu.quant import WEIGHT_KERNELS


class CpuOps(TorchOps):
    name = "cpu"
    weight_kernels = WEIGHT_KERNELS
