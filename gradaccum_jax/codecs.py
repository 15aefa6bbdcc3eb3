"""Compression codecs: what goes over the wire of a cross-device mean or sum.

A codec turns each device's tensor into what the devices exchange (integer
codes, sparse entries, low-rank factors) and back into the sum over the
devices, with its own state. Plug one in with
`gradaccum_jax.compressed_average_across_devices` (``jax.pmap`` /
``jax.shard_map``, and ``diloco(outer_reduction=)``) or
`gradaccum_jax.compressed_window_reduction` (``MultiSteps(
window_reduction=)`` on a mesh); write one against
`gradaccum_jax.extend.Codec`.

- `ternary`: {-1, 0, 1} times a scale per leaf, packed in base-(2n + 1)
  digits (1/7 of float32's bytes with 8 devices);
- `quantized`: 8-bit integers or 4-bit E2M1 floats, a power-of-two scale
  per block of 32;
- `topk`: the largest entries of each chunk of 4096, in 1 to 32 bits with
  their indices (or, at a high density, as a map of the chunk's codes: 1.6
  bits an element in one bit), all-gathered, or summed by each shard's
  owner (``collective="reduce_scatter"``: about two payloads received per
  device, whatever their number);
- `powersgd`: a warm-started rank-r product per matrix.

Scanned leaves: a leaf of rank 3 or more is a stack of layers along its
leading axis (the params of a ``jax.lax.scan`` over layers). `ternary`
gives each layer a scale of its own and PowerSGD factors each layer's
matrix on its own; `quantized` and `topk` scale each block of 32 or chunk
of 4096 consecutive elements, which never straddles two layers whose size
is a multiple of it.

A leaf split over another mesh axis (tensor parallelism) is coded where it
lies: each device codes its own block (blocks of 32 and chunks of 4096 are
then those of its block); PowerSGD gathers the leaf over that axis.
"""

from gradaccum_jax._codecs._powersgd import powersgd
from gradaccum_jax._codecs._quantized import quantized
from gradaccum_jax._codecs._ternary import ternary
from gradaccum_jax._codecs._topk import topk

__all__ = ["powersgd", "quantized", "ternary", "topk"]
