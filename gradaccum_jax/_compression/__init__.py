"""What every compressed reduction shares, below the codecs that use it:
blocks of split leaves, Auto splits, random streams, leaf checks and error
feedback (docs/architecture.md lists the modules). Nothing here imports
`gradaccum_jax._codecs` or `gradaccum_jax._ternary`.
"""
