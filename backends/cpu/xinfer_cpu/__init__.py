"""xinfer's CPU backend: the plain-torch reference ops (:mod:`xinfer.torch_ops`) on the CPU."""
