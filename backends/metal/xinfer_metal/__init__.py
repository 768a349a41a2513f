"""xinfer's Metal backend: the plain-torch ops on Apple silicon's ``mps`` device, with Metal
kernels (compiled at run time through ``torch.mps.compile_shader``) for the paged KV cache."""
