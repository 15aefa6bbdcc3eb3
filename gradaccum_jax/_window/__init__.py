"""The accumulation window: how its sum is stored and how many micro-batches
it holds, one module per part (docs/architecture.md lists them). The
engine (`gradaccum_jax._accumulation`) calls these parts through their
protocols; nothing here imports it.
"""
