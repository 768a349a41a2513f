"""Triton kernels of the Gated DeltaNet ops (:mod:`xinfer_qwen.deltanet_ops` holds their
references), which the CUDA backend runs: the causal conv1d (:mod:`.conv1d`) and the gated
delta rule (:mod:`.delta_rule`)."""
