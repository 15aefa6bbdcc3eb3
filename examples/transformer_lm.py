"""A small transformer language model, end to end, on 8 devices.

A decoder-only transformer (flax.nnx, bfloat16 activations over float32
parameters, float32 loss and accumulation) learns to predict the next byte
of the Python standard library's own source files: every Python
installation has them, so nothing is downloaded. The same tokens, in the
same order, from the same initial parameters, train five runs under
``jax.jit`` on a mesh of all devices (8 emulated CPU devices in the tests):

1. ``big_batch``: plain ``jax.grad`` of the global batch sharded over
   ``"data"`` (XLA all-reduces the gradients on every step);
2. ``multisteps``: the same global batch as k micro-batches,
   `gradaccum_jax.local_value_and_grad` (per-device gradients, weighted by
   their valid tokens) and ``MultiSteps(..., unreduced_axes="data")``: one
   all-reduce per window;
3. ``microbatched``: `gradaccum_jax.microbatched_value_and_grad` splits the
   global batch into k micro-batches inside one step;
4. ``ternary``: as 2, the window's all-reduce sending ternary codes
   (`gradaccum_jax.ternary_window_reduction`);
5. ``adaptive``: as 2, the window following the gradient noise scale
   (`gradaccum_jax.adaptive_every_k`).

The optimizer is AdamW with linear warmup and cosine decay after
`gradaccum_jax.clip_by_global_norm`. The last sequence of every file is
padded: its padding is masked out of the loss, and every micro-batch
weighs its number of valid tokens, so 2 and 3 compute the big-batch
gradient. Each run reports validation loss at equal numbers of tokens, the
bytes its compiled step all-reduces (read from the HLO), the compiled
memory and the time per global batch.

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python
examples/transformer_lm.py`` (the small configuration, about 30 s on a CPU).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

VOCAB = 256  # byte-level tokens
PAD = 0  # source files hold no NUL byte: padding never looks like text
METHODS = ("big_batch", "multisteps", "microbatched", "ternary", "adaptive")


@dataclasses.dataclass(frozen=True)
class Config:
    """Model, data and training sizes. ``batch`` sequences per update."""

    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int  # global sequences per update (k micro-batches together)
    k: int  # micro-batches per update
    updates: int
    warmup: int
    eval_every: int  # in updates (global batches of tokens)
    train_bytes: int  # read train files until this many bytes
    val_sequences: int
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    max_norm: float = 1.0
    k_max: int = 8  # the adaptive window's largest k (k_min is 2)
    seed: int = 0


CONFIGS = {
    # CI: 35k parameters, 1,024 tokens per update, about 30 s on 2 CPU cores
    # (compiling the five steps is most of it).
    "small": Config(
        d_model=32,
        n_layers=2,
        n_heads=2,
        seq_len=32,
        batch=32,
        k=4,
        updates=16,
        warmup=2,
        eval_every=4,
        train_bytes=400_000,
        val_sequences=64,
    ),
    # An accelerator: about 3.2M parameters, 16,384 tokens per update.
    "medium": Config(
        d_model=256,
        n_layers=4,
        n_heads=4,
        seq_len=128,
        batch=128,
        k=4,
        updates=400,
        warmup=40,
        eval_every=20,
        train_bytes=4_000_000,
        val_sequences=256,
        learning_rate=2e-3,
        k_max=16,
    ),
}


# --- the corpus -------------------------------------------------------------


def stdlib_files() -> list[pathlib.Path]:
    """The standard library's top-level ``*.py`` files, sorted by name.

    Top level only: every installation has these (some distributions strip
    the ``test`` package), and a fixed order makes the corpus the same on
    every call.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"), key=lambda path: path.name)


def split_files(
    files: list[pathlib.Path], val_every: int = 10
) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """(train, validation): every ``val_every``-th file is held out whole."""
    val = files[val_every - 1 :: val_every]
    held_out = set(val)
    return [f for f in files if f not in held_out], val


def read_bytes(files: list[pathlib.Path], max_bytes: int) -> list[np.ndarray]:
    """The files' bytes in order, stopping after ``max_bytes`` in total."""
    docs, total = [], 0
    for path in files:
        if total >= max_bytes:
            break
        data = np.frombuffer(path.read_bytes(), np.uint8)[: max_bytes - total]
        docs.append(data)
        total += len(data)
    return docs


def to_sequences(docs: list[np.ndarray], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Each file cut into windows of ``seq_len + 1`` bytes (inputs + targets).

    A file's last window is padded with ``PAD``; ``mask`` (float32, one per
    target) is 0 on the padding, so those sequences hold fewer valid tokens.
    """
    tokens, mask = [], []
    for doc in docs:
        for start in range(0, max(len(doc) - 1, 1), seq_len):
            chunk = doc[start : start + seq_len + 1]
            padded = np.full(seq_len + 1, PAD, np.int32)
            padded[: len(chunk)] = chunk
            valid = np.zeros(seq_len, np.float32)
            valid[: len(chunk) - 1] = 1.0
            tokens.append(padded)
            mask.append(valid)
    return np.stack(tokens), np.stack(mask)


@dataclasses.dataclass
class Corpus:
    train_files: list[str]
    val_files: list[str]
    train_tokens: np.ndarray  # (N, seq_len + 1) int32
    train_mask: np.ndarray  # (N, seq_len) float32
    val_tokens: np.ndarray
    val_mask: np.ndarray


def load_corpus(cfg: Config) -> Corpus:
    """Train and validation sequences of the stdlib, split by file."""
    train_files, val_files = split_files(stdlib_files())
    train = to_sequences(read_bytes(train_files, cfg.train_bytes), cfg.seq_len)
    # Validation: a fixed set of sequences spread evenly over all the
    # held-out files (a tenth of the library, about half a megabyte).
    val_tokens, val_mask = to_sequences(read_bytes(val_files, 1 << 30), cfg.seq_len)
    pick = np.linspace(0, len(val_tokens) - 1, cfg.val_sequences).astype(int)
    return Corpus(
        [f.name for f in train_files],
        [f.name for f in val_files],
        *train,
        val_tokens[pick],
        val_mask[pick],
    )


def global_batches(corpus: Corpus, cfg: Config) -> Iterator[tuple[np.ndarray, ...]]:
    """``cfg.updates`` batches of ``cfg.batch`` sequences, reshuffled per epoch."""
    rng = np.random.default_rng(cfg.seed)
    n = len(corpus.train_tokens)
    per_epoch = n // cfg.batch
    for step in range(cfg.updates):
        if step % per_epoch == 0:
            order = rng.permutation(n)
        idx = order[(step % per_epoch) * cfg.batch :][: cfg.batch]
        yield corpus.train_tokens[idx], corpus.train_mask[idx]


# --- the model --------------------------------------------------------------


class Block(nnx.Module):
    """Pre-norm causal self-attention and MLP, computing in bfloat16."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        d, low = cfg.d_model, jnp.bfloat16
        kw = dict(dtype=low, param_dtype=jnp.float32, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d, **kw)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.n_heads, in_features=d, decode=False, **kw
        )
        self.ln2 = nnx.LayerNorm(d, **kw)
        self.up = nnx.Linear(d, 4 * d, **kw)
        self.down = nnx.Linear(4 * d, d, **kw)

    def __call__(self, h: jax.Array, mask: jax.Array) -> jax.Array:
        h = h + self.attn(self.ln1(h), mask=mask)
        return h + self.down(nnx.gelu(self.up(self.ln2(h))))


class TransformerLM(nnx.Module):
    """Decoder-only byte-level transformer with tied input/output embeddings."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.embed = nnx.Embed(VOCAB, cfg.d_model, **kw)
        self.pos = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model))
        )
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        # A one-hot matmul rather than a gather: under explicit sharding a
        # gather from a replicated table by batch-sharded indices needs its
        # output sharding spelled out, a matmul propagates it (and with 256
        # tokens it costs what the output projection costs).
        one_hot = jax.nn.one_hot(x, VOCAB, dtype=jnp.bfloat16)
        table = self.embed.embedding[...].astype(jnp.bfloat16)
        h = one_hot @ table + self.pos[...].astype(jnp.bfloat16)
        mask = nnx.make_causal_mask(x)
        for block in self.blocks:
            h = block(h, mask)
        # Logits in bfloat16, the softmax and the loss in float32.
        return self.embed.attend(self.ln_f(h)).astype(jnp.float32)


def init_model(cfg: Config) -> tuple[nnx.GraphDef, dict]:
    """The model's graph and its float32 parameters (a plain pytree)."""
    graphdef, state = nnx.split(TransformerLM(cfg, nnx.Rngs(cfg.seed)))
    return graphdef, jax.device_get(nnx.to_pure_dict(state))


def n_params(params: Any) -> int:
    return sum(int(np.size(leaf)) for leaf in jax.tree.leaves(params))


def make_loss(graphdef: nnx.GraphDef) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """``loss(params, tokens, mask) -> (mean over valid tokens, their count)``."""

    def loss(params, tokens, mask):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        per_token = optax.softmax_cross_entropy_with_integer_labels(
            logits, tokens[:, 1:]
        )
        count = jnp.sum(mask)
        return jnp.sum(mask * per_token) / jnp.maximum(count, 1.0), count

    return loss


# --- the train steps --------------------------------------------------------


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """Clip, then AdamW with linear warmup and cosine decay (per update)."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup, cfg.updates, cfg.learning_rate / 10
    )
    return optax.chain(
        ga.clip_by_global_norm(cfg.max_norm),
        optax.adamw(schedule, weight_decay=cfg.weight_decay),
    )


@dataclasses.dataclass
class Method:
    """A run's optimizer and jitted step; ``calls_per_update`` of its step."""

    opt: Any  # an optax transformation or a MultiSteps
    step: Callable[..., Any]
    calls_per_update: int  # the fixed windows' k; 1 for a whole-batch step


def build_method(name: str, cfg: Config, loss: Callable[..., Any]) -> Method:
    """The optimizer and the (unjitted) train step of run ``name``.

    Every step is ``step(params, state, tokens, mask) -> (params, state,
    info)``, with ``info`` a dict of replicated scalars.
    """
    inner = make_optimizer(cfg)
    if name == "big_batch":
        grad_fn = jax.grad(lambda p, t, m: loss(p, t, m)[0])
        return Method(inner, _whole_batch_step(inner, grad_fn), 1)
    if name == "microbatched":
        grad_fn = ga.microbatched_value_and_grad(
            lambda p, batch: loss(p, *batch)[0],
            cfg.k,
            weight_fn=lambda batch: jnp.sum(batch[1]),
            data_axis="data",
        )
        return Method(
            inner, _whole_batch_step(inner, lambda p, t, m: grad_fn(p, (t, m))[1]), 1
        )
    extra: dict[str, Any] = {}
    every_k: Any = cfg.k
    if name == "ternary":
        extra["window_reduction"] = ga.ternary_window_reduction(cfg.seed)
    elif name == "adaptive":
        # The schedule counts updates: a run that takes more than
        # ``cfg.updates`` of them ends its cosine early and goes on at the
        # final rate (a tenth of the peak).
        tokens_per_micro_batch = cfg.batch // cfg.k * cfg.seq_len
        every_k = ga.adaptive_every_k(tokens_per_micro_batch, k_min=2, k_max=cfg.k_max)
        # The estimate steers the window: every micro-batch's norm (the
        # sampled default is noisier, one micro-batch in k).
        extra["noise_scale_estimator"] = "all"
    elif name != "multisteps":
        raise ValueError(f"`name` must be one of {METHODS}, got {name!r}.")
    opt = ga.MultiSteps(inner, every_k, unreduced_axes="data", **extra)
    return Method(opt, _window_step(opt, loss), cfg.k)


def _whole_batch_step(opt, grad_fn):
    def step(params, state, tokens, mask):
        grads = grad_fn(params, tokens, mask)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, {}

    return step


def _window_step(opt: ga.MultiSteps, loss):
    # Per-device gradients of the device's mean loss, times its valid
    # tokens; the window is sum(w g) / sum(w), the big-batch gradient.
    grad_fn = ga.local_value_and_grad(loss, "data", has_weight=True)

    def step(params, state, tokens, mask):
        (_, weight), grads = grad_fn(params, tokens, mask)
        updates, state = opt.update(grads, state, params, weight=weight)
        stats = opt.stats(state)
        info = {"window_size": stats.window_size, "noise_scale": stats.noise_scale}
        return optax.apply_updates(params, updates), state, info

    return step


# --- the run loop -----------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    """What one run measured; bytes and memory from its compiled step."""

    name: str
    tokens: list[int]  # tokens seen (valid or not) at each evaluation
    val_loss: list[float]
    seconds_per_batch: float  # median wall time per global batch of tokens
    all_reduce_bytes_per_token: float
    temp_bytes: int  # compiled step's temporaries (per device)
    argument_bytes: int  # its inputs: params, optimizer state, micro-batch
    window_size: list[int]  # per call (the window in progress), windowed runs
    noise_scale: list[float]  # B_simple in tokens, per call, windowed runs
    updates: int  # optimizer updates applied


def _bytes_per_call_and_window(compiled) -> tuple[int, int]:
    """All-reduced bytes on every call, and once per emitted window."""
    ops = ga.measure.all_reduces(compiled)
    every_call = sum(op.nbytes for op in ops if op.place == "entry")
    return every_call, sum(op.nbytes for op in ops) - every_call


def evaluator(loss, mesh, corpus: Corpus) -> Callable[[Any], float]:
    """``evaluate(params)``: the mean loss over the validation set's tokens."""
    on_data = NamedSharding(mesh, P("data"))
    tokens = jax.device_put(corpus.val_tokens, on_data)
    mask = jax.device_put(corpus.val_mask, on_data)
    evaluate = jax.jit(lambda params: loss(params, tokens, mask)[0])
    return lambda params: float(evaluate(params))


def train(
    name: str, cfg: Config, corpus: Corpus, graphdef, params0, mesh, evaluate=None
) -> RunResult:
    """Trains run ``name`` from ``params0`` on the global batches in order.

    ``evaluate(params) -> validation loss``: pass one `evaluator` to every
    run so that it compiles once.
    """
    loss = make_loss(graphdef)
    method = build_method(name, cfg, loss)
    if evaluate is None:
        evaluate = evaluator(loss, mesh, corpus)
    on_data = NamedSharding(mesh, P("data"))
    parts = method.calls_per_update  # calls per global batch of tokens
    with jax.set_mesh(mesh):  # before init: the window is built for it
        params = jax.device_put(params0, NamedSharding(mesh, P()))
        state = jax.jit(method.opt.init)(params)
        shape = (cfg.batch // parts, cfg.seq_len)
        example = (
            jax.ShapeDtypeStruct((shape[0], shape[1] + 1), jnp.int32, sharding=on_data),
            jax.ShapeDtypeStruct(shape, jnp.float32, sharding=on_data),
        )
        compiled = (
            jax.jit(method.step, donate_argnums=(0, 1))
            .lower(params, state, *example)
            .compile()
        )
        result = _run(name, cfg, corpus, compiled, params, state, evaluate, parts, mesh)
    every_call, per_window = _bytes_per_call_and_window(compiled)
    tokens_per_call = cfg.batch // parts * cfg.seq_len
    windows = max(result.updates, 1)
    calls = cfg.updates * parts
    result.all_reduce_bytes_per_token = (every_call * calls + per_window * windows) / (
        calls * tokens_per_call
    )
    memory = compiled.memory_analysis()
    result.temp_bytes = int(memory.temp_size_in_bytes)
    result.argument_bytes = int(memory.argument_size_in_bytes)
    return result


def _run(
    name, cfg, corpus, compiled, params, state, evaluate, parts, mesh
) -> RunResult:
    on_data = NamedSharding(mesh, P("data"))
    result = RunResult(name, [0], [evaluate(params)], 0.0, 0.0, 0, 0, [], [], 0)
    seconds = []
    for index, (tokens, mask) in enumerate(global_batches(corpus, cfg), start=1):
        start = time.perf_counter()
        for part in range(parts):
            batch = (tokens[part::parts], mask[part::parts])
            batch = [jax.device_put(leaf, on_data) for leaf in batch]
            # One step in flight at a time: interleaved collectives on
            # emulated devices can deadlock.
            params, state, info = jax.block_until_ready(compiled(params, state, *batch))
            if info:
                result.window_size.append(int(info["window_size"]))
                result.noise_scale.append(float(info["noise_scale"]))
        seconds.append(time.perf_counter() - start)
        if index % cfg.eval_every == 0:
            result.tokens.append(index * cfg.batch * cfg.seq_len)
            result.val_loss.append(evaluate(params))
    result.seconds_per_batch = float(np.median(seconds))
    result.updates = (
        int(jax.device_get(state.gradient_step)) if parts > 1 else cfg.updates
    )
    return result


def default_mesh() -> jax.sharding.Mesh:
    """Every device on one explicit ``"data"`` axis."""
    return jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,)
    )


def run_all(
    cfg: Config, methods: tuple[str, ...] = METHODS, mesh=None
) -> dict[str, RunResult]:
    """Every run of ``methods`` on the same tokens from the same parameters."""
    mesh = default_mesh() if mesh is None else mesh
    if cfg.batch % (cfg.k * mesh.shape["data"]):
        raise ValueError(
            f"`batch` ({cfg.batch}) must be divisible by k ({cfg.k}) times the "
            f"{mesh.shape['data']} devices."
        )
    corpus = load_corpus(cfg)
    graphdef, params0 = init_model(cfg)
    evaluate = evaluator(make_loss(graphdef), mesh, corpus)
    return {
        name: train(name, cfg, corpus, graphdef, params0, mesh, evaluate)
        for name in methods
    }


def table(results: dict[str, RunResult]) -> str:
    """One line per run: final validation loss, bytes, memory, time, k."""
    lines = [
        f"{'run':13s} {'val loss':>8s} {'updates':>7s} {'AR B/token':>10s} "
        f"{'temp KiB':>8s} {'ms/batch':>8s} {'last k':>6s}"
    ]
    for r in results.values():
        k = r.window_size[-1] if r.window_size else "-"
        lines.append(
            f"{r.name:13s} {r.val_loss[-1]:8.4f} {r.updates:7d} "
            f"{r.all_reduce_bytes_per_token:10.2f} {r.temp_bytes / 1024:8.0f} "
            f"{1e3 * r.seconds_per_batch:8.1f} {k!s:>6s}"
        )
    return "\n".join(lines)


def main(size: str = "small") -> dict[str, RunResult]:
    cfg = CONFIGS[size]
    graphdef, params0 = init_model(cfg)
    print(
        f"{size}: {n_params(params0):,} parameters, {jax.device_count()} "
        f"{jax.devices()[0].platform} devices, {cfg.updates} updates of "
        f"{cfg.batch * cfg.seq_len:,} tokens (k={cfg.k})"
    )
    results = run_all(cfg)
    print(table(results))
    return results


if __name__ == "__main__":
    main()
