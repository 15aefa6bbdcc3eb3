"""Compression codecs: one protocol for every compressed cross-device sum.

- `_protocol`: the `Codec` protocol, its `Wire` and `CodecSum`, the state
  `CodecState`;
- `_mean`: what every codec shares (weights, exact leaves, error feedback,
  non-finite devices) around one codec's sum;
- `_average`: `compressed_average_across_devices` (pmap / shard_map);
- `_window`: `compressed_window_reduction` (a window's per-device terms);
- `_auto_blocks`: a codec run on each device's block of leaves split over
  Auto mesh axes (DiLoCo's stacked workers);
- `_packing`: integer codes summed exactly, several per uint32 word;
- `_chunks`: top-k's payload, chunk by chunk;
- `_ternary_kernels`: the ternary quantizers (TernGrad's, TWN's), which
  `ternarize` and `ternary_accumulate` use too;
- `_ternary`, `_quantized`, `_topk`, `_powersgd`: the codecs.

What they share with `gradaccum_jax.ternarize` and `gradaccum_jax.diloco`
(blocks, random streams, error feedback) is in `gradaccum_jax._compression`.
"""
