"""The Metal kernels: each ``.metal`` file here is one library, bound by :mod:`xinfer_metal.shaders`."""
