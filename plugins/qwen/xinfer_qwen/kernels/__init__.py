"""Triton kernels of the Gated DeltaNet ops (:mod:`xinfer_qwen.deltanet_ops` holds their
references), which the CUDA backend runs: the causal conv1d (:mod:`.conv1d`), the gated
delta rule with its gates (:mod:`.delta_rule`) and the gated RMSNorm of its output (:mod:`.gated_norm`)."""
