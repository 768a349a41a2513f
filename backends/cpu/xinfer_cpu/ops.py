"""The CPU backend computes with the plain-torch reference as it is."""

from xinfer.torch_ops import TorchOps


class CpuOps(TorchOps):
    name = "cpu"
