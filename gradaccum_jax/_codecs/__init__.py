"""Compression codecs: one protocol for every compressed cross-device sum.

A codec (`_protocol.Codec`) only sums what it is given; `_mean` does what
every codec shares around it, for the device mean (`_average`) and the
window's sum (`_window`). What codecs share with `gradaccum_jax.ternarize`
and `gradaccum_jax.diloco` (blocks, random streams, error feedback) is
below, in `gradaccum_jax._compression`. docs/architecture.md lists the
modules.
"""
