"""Every collective of a compiled program: bytes, device groups, mesh axes
and where it runs.

Reads the optimized HLO text (``compiled.as_text()``): its computations and
which calls which (a while loop's body, a conditional's branch, a fusion or
an async wrapper), each collective instruction's shapes and its device
groups in whichever form XLA writes them.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import numpy as np

_HLO_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1,
}  # fmt: skip
_HLO_SHAPE = re.compile(r"\b([a-z][a-z\d]*)\[([\d,]*)\]")
_HLO_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


class Collective(NamedTuple):
    """One collective instruction of compiled HLO.

    Attributes:
      kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``,
        ``"all-to-all"`` or ``"collective-permute"`` (an async
        ``-start`` / ``-done`` pair is one collective).
      name: the HLO instruction's name, to find it in ``as_text()``.
      shapes: its result buffers as HLO writes them (``"f32[32,8]"``);
        several for a fused tuple collective.
      nbytes: bytes of its result buffers, on one device.
      operand_nbytes: bytes of its operand buffers, on one device. The two
        differ by the group size for an all-gather (result larger) and a
        reduce-scatter (operand larger); `received_nbytes` is what a ring
        moves to each device.
      groups: the device groups that take part, as logical device ids (the
        positions in ``mesh.devices.flat``); for a collective-permute, the
        sets of devices its source-target pairs connect.
      group_size: devices per group (the largest group where they differ).
      axes: the mesh axes a group spans, in the mesh's order, when a
        ``mesh`` was given and every group is one whole sub-mesh over them;
        otherwise None.
      place: ``"entry"`` (runs once per call of the program), ``"loop"``
        (inside a while loop's body or condition, directly or in a
        computation called from there) or ``"branch"`` (in a conditional's
        branch, outside any loop).
      trips: the trip count of each enclosing while loop, outermost first,
        None where XLA does not know it (a loop over a runtime condition,
        such as one that runs zero or one time); ``()`` outside loops. A
        scan over layers has a known count: the collective runs that many
        times per call.
    """

    kind: str
    name: str
    shapes: tuple[str, ...]
    nbytes: int
    operand_nbytes: int
    groups: tuple[tuple[int, ...], ...]
    group_size: int
    axes: tuple[str, ...] | None
    place: str
    trips: tuple[int | None, ...]

    @property
    def received_nbytes(self) -> float:
        """The bytes one device receives, by the ring estimate, per run.

        Over a group of ``n`` devices a ring all-reduce receives
        ``2 (n - 1) / n`` of its buffer on each device (a reduce-scatter,
        then an all-gather), an all-gather ``(n - 1) / n`` of its result,
        a reduce-scatter ``(n - 1) / n`` of its operand, an all-to-all
        ``(n - 1) / n`` of its buffer; a collective-permute receives its
        whole buffer. The one formula of what crosses the links, for
        comparing programs: XLA's real algorithms may differ.
        """
        n = self.group_size
        if n < 2:
            return 0.0
        share = (n - 1) / n
        if self.kind == "all-reduce":
            return 2 * share * self.nbytes
        if self.kind == "reduce-scatter":
            return share * self.operand_nbytes
        if self.kind == "collective-permute":
            return float(self.nbytes)
        return share * self.nbytes  # all-gather (its result), all-to-all


_HLO_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([a-z][\w\-]*)\((.*)$"
)
_HLO_CALLEE = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
_HLO_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_HLO_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_HLO_NUM_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_HLO_REPLICA_COUNT = re.compile(r"\breplica_count=(\d+)")
_HLO_LISTED_GROUPS = re.compile(
    r"\b(?:replica_groups|source_target_pairs)=\{(\{[\d,{}]*\}|)\}"
)
# Groups written over a mesh of named axes: the mesh's axis sizes, its
# device at each position (row-major; an iota, maybe transposed, or a list;
# the identity when not written) and the axes the collective spans, e.g.
# ``replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0))
# {'axis_1'}``.
_HLO_MESH_GROUPS = re.compile(
    r"\breplica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}"
)
_HLO_IOTA_GROUPS = re.compile(
    r"\breplica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"
)


class _Computation(NamedTuple):
    """The instructions of one HLO computation, as text, and what it calls."""

    is_entry: bool
    lines: list[str]
    calls: list[tuple[str, str, int | None]]  # (callee, "call"/"loop"/"branch", trips)


def collectives(compiled: Any, mesh: Any = None) -> list[Collective]:
    """Returns every collective of compiled HLO with its bytes, axes and place.

    Reads the instructions of the optimized HLO (``compiled.as_text()``):
    all-reduce, all-gather, reduce-scatter, all-to-all and
    collective-permute, synchronous or as an async ``-start`` / ``-done``
    pair, wherever they sit (the entry computation, a loop's body, a
    conditional's branch, an async wrapper). Like `all_reduces`, it counts
    instructions, not their executions: ``place`` and ``trips`` say how
    often each runs. Collectives over groups of one device move nothing and
    are left out.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from gradaccum_jax import measure
    >>> from jax.sharding import AxisType
    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    >>> with jax.set_mesh(mesh):
    ...     x = jax.device_put(jnp.ones((8, 256)), jax.P("data"))
    ...     compiled = jax.jit(lambda x: x.sum(axis=0)).lower(x).compile()
    >>> [(op.kind, op.nbytes, op.axes) for op in measure.collectives(compiled, mesh)]
    [('all-reduce', 1024, ('data',))]

    Args:
      compiled: ``jax.jit(f).lower(...).compile()``, or its ``as_text()``.
      mesh: the ``jax.sharding.Mesh`` the program was compiled for, to name
        the mesh axes of each collective's groups (``Collective.axes``);
        logical device ``i`` of the HLO is the ``i``-th device of
        ``mesh.devices.flat``. Without it ``axes`` is None.

    Returns:
      One `Collective` per collective instruction, in the order of the HLO
      text.
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    computations = _computations(text)
    placed = _places(computations)
    num_devices = _num_devices(text)
    found = []
    for name, computation in computations.items():
        if name not in placed:
            continue  # dead code: no path from the entry computation
        instructions = [
            (*match.groups(), line)
            for line in computation.lines
            if (match := _HLO_INSTRUCTION.match(line))
        ]
        shapes_of = {result: shape for result, shape, *_ in instructions}
        # An async pair's result is the shape its ``-done`` writes.
        for _, shape, opcode, rest, _ in instructions:
            if opcode.endswith("-done") and opcode[:-5] in COLLECTIVE_KINDS:
                start, *_ = re.findall(r"%([\w.\-]+)", rest)
                shapes_of[start] = shape
        for result, _, opcode, rest, line in instructions:
            kind = opcode.removesuffix("-start")
            if kind not in COLLECTIVE_KINDS:
                continue
            groups = _groups(line, kind, num_devices)
            if max(map(len, groups)) < 2:
                continue
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            shape = shapes_of[result]
            found.append(
                Collective(
                    kind=kind,
                    name=result,
                    shapes=tuple(f"{t}[{d}]" for t, d in _HLO_SHAPE.findall(shape)),
                    nbytes=_text_nbytes(shape, line),
                    operand_nbytes=sum(
                        _text_nbytes(shapes_of[o], line)
                        for o in operands
                        if o in shapes_of
                    ),
                    groups=groups,
                    group_size=max(map(len, groups)),
                    axes=None if mesh is None else _mesh_axes(groups, mesh),
                    place=placed[name][0],
                    trips=placed[name][1],
                )
            )
    return found


def _text_nbytes(shape: str, where: str) -> int:
    """Bytes of the buffers of an HLO shape's text (a tuple's summed)."""
    return _shapes_nbytes(_HLO_SHAPE.findall(shape), where)


def _computations(text: str) -> dict[str, _Computation]:
    """The HLO module's computations by name, in the order of the text."""
    computations = {}
    current = None
    for line in text.splitlines():
        header = _HLO_COMPUTATION.match(line)
        if header and not line.startswith(" "):
            current = _Computation(bool(header.group(1)), [], [])
            computations[header.group(2)] = current
            continue
        if current is None or not line.strip() or line.strip() == "}":
            continue
        current.lines.append(line)
        if " while(" in line:
            trips = _HLO_TRIP_COUNT.search(line)
            count = int(trips.group(1)) if trips else None
            for callee in _HLO_CALLEE.findall(line):
                current.calls.append((callee, "loop", count))
            continue
        kind = "branch" if " conditional(" in line else "call"
        for callee in _HLO_CALLEE.findall(line):
            current.calls.append((callee, kind, None))
        for listed in _HLO_BRANCHES.findall(line):
            for callee in re.findall(r"%?([\w.\-]+)", listed):
                current.calls.append((callee, "branch", None))
    return computations


def _places(
    computations: dict[str, _Computation],
) -> dict[str, tuple[str, tuple[int | None, ...]]]:
    """Where each computation reachable from the entry runs: place and trips.

    A computation called from several places takes the first path found
    from the entry, breadth first; XLA's SPMD output calls a computation
    holding a collective from one place.
    """
    entry = next((n for n, c in computations.items() if c.is_entry), None)
    if entry is None:
        raise ValueError("collectives: the HLO text has no ENTRY computation.")
    placed: dict[str, tuple[str, tuple[int | None, ...]]] = {entry: ("entry", ())}
    queue = [entry]
    while queue:
        caller = queue.pop(0)
        place, trips = placed[caller]
        for callee, how, count in computations[caller].calls:
            if callee in placed or callee not in computations:
                continue
            if how == "loop":
                placed[callee] = ("loop", (*trips, count))
            elif how == "branch" and place == "entry":
                placed[callee] = ("branch", trips)
            else:
                placed[callee] = (place, trips)
            queue.append(callee)
    return placed


def _num_devices(text: str) -> int:
    """Devices of the program: partitions times replicas (its header)."""
    partitions = _HLO_NUM_PARTITIONS.search(text)
    replicas = _HLO_REPLICA_COUNT.search(text)
    return (int(partitions.group(1)) if partitions else 1) * (
        int(replicas.group(1)) if replicas else 1
    )


def _groups(line: str, kind: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of a collective instruction, whichever way written."""
    if "replica_groups=mesh[" in line:
        return _mesh_groups(line)
    iota = _HLO_IOTA_GROUPS.search(line)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        reshape = [int(d) for d in iota.group(2).split(",")]
        ids = np.arange(np.prod(reshape, dtype=np.int64)).reshape(reshape)
        if iota.group(3):
            ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape))
    listed = _HLO_LISTED_GROUPS.search(line)
    if listed is None and re.search(r"\b(?:replica_groups|source_target_pairs)=", line):
        raise ValueError(
            f"collectives: replica groups written in a form it cannot read: {line!r}"
        )
    if listed is None or not listed.group(1):
        # No groups written (``replica_groups={}``): one group of all devices.
        return (tuple(range(num_devices)),)
    groups = tuple(
        tuple(int(i) for i in group.split(",") if i)
        for group in re.findall(r"\{([\d,]*)\}", listed.group(1))
    )
    if kind == "collective-permute":
        return _connected(groups)
    return groups


def _mesh_groups(line: str) -> tuple[tuple[int, ...], ...]:
    """The groups of ``replica_groups=mesh[...]``: devices along its axes."""
    written = _HLO_MESH_GROUPS.search(line)
    if written is None:
        raise ValueError(
            f"collectives: replica groups written in a form it cannot read: {line!r}"
        )
    axes = re.findall(r"'?([\w.]+)'?=(\d+)", written.group(1))
    names = [name for name, _ in axes]
    spanned = [token.strip().strip("'") for token in written.group(3).split(",")]
    if not names or not all(name in names for name in spanned):
        raise ValueError(
            f"collectives: replica groups written in a form it cannot read: {line!r}"
        )
    sizes = [int(size) for _, size in axes]
    count = int(np.prod(sizes, dtype=np.int64))
    devices = (
        np.arange(count)
        if written.group(2) is None
        else _device_ids(written.group(2), count, line)
    )
    kept = [names.index(name) for name in spanned]
    fixed = [axis for axis in range(len(names)) if axis not in kept]
    rows = devices.reshape(sizes).transpose(fixed + kept)
    return tuple(
        tuple(int(i) for i in row)
        for row in rows.reshape(-1, int(np.prod([sizes[a] for a in kept])))
    )


def _device_ids(written: str, count: int, line: str) -> np.ndarray:
    """The devices of ``device_ids=(...)``: an iota (``[2,4]T(1,0)``) or a list."""
    iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", written.strip())
    if iota:
        dims = [int(d) for d in iota.group(1).split(",")]
        ids = np.arange(np.prod(dims, dtype=np.int64)).reshape(dims)
        if iota.group(2):
            ids = ids.transpose([int(d) for d in iota.group(2).split(",")])
        ids = ids.reshape(-1)
    else:
        ids = np.array([int(i) for i in re.findall(r"\d+", written)])
    if ids.size != count:
        raise ValueError(
            f"collectives: {ids.size} device ids for a mesh of {count}: {line!r}"
        )
    return ids


def _connected(pairs: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The sets of devices that source-target pairs connect, each sorted."""
    owner: dict[int, int] = {}

    def root(device: int) -> int:
        while owner.setdefault(device, device) != device:
            device = owner[device]
        return device

    for source, target in pairs:
        owner[root(source)] = root(target)
    components: dict[int, list[int]] = {}
    for device in sorted(owner):
        components.setdefault(root(device), []).append(device)
    return tuple(tuple(devices) for devices in components.values())


def _mesh_axes(
    groups: tuple[tuple[int, ...], ...], mesh: Any
) -> tuple[str, ...] | None:
    """The mesh axes every group spans whole, or None if they are not axes."""
    shape = tuple(mesh.devices.shape)
    if max(max(group) for group in groups) >= int(np.prod(shape)):
        return None  # devices beyond the mesh: a program for another mesh
    spans = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.array(group), shape)).T
        varying = tuple(
            axis for axis in range(len(shape)) if len(set(coords[:, axis])) > 1
        )
        size = int(np.prod([shape[axis] for axis in varying], dtype=np.int64))
        if len(set(map(tuple, coords))) != size:
            return None  # part of an axis, or a mix of axes: not a sub-mesh
        spans.add(varying)
    if len(spans) != 1:
        return None
    (varying,) = spans
    return tuple(mesh.axis_names[axis] for axis in varying)


def _shapes_nbytes(shapes: list[tuple[str, str]], where: str) -> int:
    total = 0
    for dtype, dims in shapes:
        if dtype not in _HLO_DTYPE_BYTES:
            raise ValueError(
                f"unknown HLO element type {dtype!r} in {where!r}: the byte "
                f"counts know {sorted(_HLO_DTYPE_BYTES)}."
            )
        total += (
            int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
            * (_HLO_DTYPE_BYTES[dtype])
        )
    return total
