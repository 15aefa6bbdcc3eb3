"""The accumulation window: how its sum is stored and how many micro-batches
it holds, one module per part.

* `_accumulator`: `WindowAccumulator`, the protocol of a window's storage,
  and `float_accumulator` (the default; a `RunningMean` below float32);
* `_per_device`: `per_device_accumulator`, each device's own window;
* `_store`: the storage as the engine sees it (`WindowStore`: a
  `SharedWindow` or a `DecodedWindow`), picked once by `window_store`;
* `_size`: the window-size policies (`WindowSize`: scheduled, or
  `adaptive_every_k`'s, which reads the noise scale).

The engine (`gradaccum_jax._accumulation`) calls these parts through their
protocols; nothing here imports it.
"""
