"""What a Triton kernel that a plugin registers for this backend (``OpSpec.kernels["cuda"]``) builds
on, and the one module of this distribution such a kernel imports: the launch chain every kernel of
the backend joins (:func:`pdl_entry` first in the kernel, :func:`pdl` in the launch), the paged
attention kernels' shared pieces and the fp8 code's decoding. A plugin whose kernels import it
declares ``xinfer-cuda`` in its ``cuda`` extra; its models and torch references never import it.
"""

from xinfer_cuda.kernels.attention import LOG2E, NEG_BIG, decode_num_splits
from xinfer_cuda.kernels.attention import _tile_owner as tile_owner
from xinfer_cuda.kernels.kv_codes import FP8_MAX_C, fp8_value
from xinfer_cuda.kernels.launch import pdl, pdl_entry

__all__ = ["FP8_MAX_C", "LOG2E", "NEG_BIG", "decode_num_splits", "fp8_value", "pdl", "pdl_entry", "tile_owner"]
