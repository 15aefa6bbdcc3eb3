"""What every compressed reduction shares, below the codecs that use it.

- `_blocks`: a leaf seen as the block one device holds (its split, the
  collectives over its blocks), and the many-array psum;
- `_auto_splits`: how leaves lie over Auto mesh axes, which their types do
  not say (read from placed arrays, or told by the caller);
- `_random`: counter-based random bits, a hash of (seed, step, leaf,
  device, element);
- `_leaves`: which leaves are compressed, and the checks of the leaves a
  state is given;
- `_error_feedback`: the residual a compressor keeps of what it has not
  sent, for `gradaccum_jax.ternarize` and every codec.

Nothing here imports `gradaccum_jax._codecs` or `gradaccum_jax._ternary`.
"""
