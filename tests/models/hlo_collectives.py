"""Read collectives out of an optimized HLO module's text: which kind, how many operands, over which mesh axes,
and whether they sit in a scanned layer's loop body (what runs once per layer).

XLA prints replica groups in several forms: explicit (`{{0,1},{2,3}}`), iota (`[4,2]<=[2,2,2]T(2,1,0)`) and
mesh-axes (`mesh['axis_0'=2,'axis_1'=4] {'axis_0'}`, optionally with `device_ids=(...)`); each is turned into
the partition of device ids it names and matched against the partitions of the mesh's axis subsets. XLA's
combiners merge independent collectives into one tuple-shaped op, so counts are of operands, not of ops.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (" + "|".join(KINDS) + r")(?:-start)?\(")
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) ")
_IOTA = re.compile(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}")


@dataclass(frozen=True)
class Collective:
    kind: str
    operands: tuple[str, ...]  # result shapes, one per combined operand
    axes: frozenset[str]  # mesh axes the groups span
    computation: str


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _groups(line: str) -> list[frozenset[int]] | None:
    if "source_target_pairs=" in line:
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}?,", line).group(1)
        return [frozenset(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)", pairs)]
    m = re.search(r"replica_groups=(\S.*?)(?:, (?:use_global|channel|dimensions|to_apply|constrain)|$)", line)
    if m is None:
        return None
    text = m.group(1)
    if text.startswith("{"):
        return [frozenset(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", text)]
    if (mm := _MESH.match(text)) is not None:
        sizes = [(n.strip("'"), int(v)) for n, v in (kv.split("=") for kv in mm.group(1).split(","))]
        dims = [v for _, v in sizes]
        if mm.group(2):
            ids = _iota([int(x) for x in mm.group(2).split(",")],
                        [int(x) for x in mm.group(3).split(",")] if mm.group(3) else None).reshape(dims)
        else:
            ids = np.arange(int(np.prod(dims))).reshape(dims)
        span = {a.strip().strip("'") for a in mm.group(4).split(",")}
        keep = [i for i, (n, _) in enumerate(sizes) if n in span]
        rest = [i for i in range(len(sizes)) if i not in keep]
        grouped = ids.transpose(rest + keep).reshape(-1, int(np.prod([dims[i] for i in keep])))
        return [frozenset(g.tolist()) for g in grouped]
    if (mm := _IOTA.match(text)) is not None:
        g, s = int(mm.group(1)), int(mm.group(2))
        perm = [int(x) for x in mm.group(4).split(",")] if mm.group(4) else None
        ids = _iota([int(x) for x in mm.group(3).split(",")], perm).reshape(g, s)
        return [frozenset(row.tolist()) for row in ids]
    raise ValueError(f"unparsed replica groups: {text[:80]}")


def axis_partitions(mesh: Mesh) -> dict[frozenset[str], set[frozenset[int]]]:
    """For every non-empty subset of mesh axes: the groups of device ids that differ only along them."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    names = list(mesh.axis_names)
    out = {}
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), r):
            rest = [i for i in range(len(names)) if i not in subset]
            grouped = ids.transpose(rest + list(subset)).reshape(-1, int(np.prod([ids.shape[i] for i in subset])))
            out.setdefault(frozenset(names[i] for i in subset if ids.shape[i] > 1), set()).update(
                frozenset(g.tolist()) for g in grouped)
    return out


def _axes_of(groups: list[frozenset[int]], kind: str, partitions) -> frozenset[str]:
    real = {g for g in groups if len(g) > 1}
    if not real:
        return frozenset()
    if kind == "collective-permute":  # pairs: the fewest axes whose groups hold every pair
        for axes, parts in sorted(partitions.items(), key=lambda kv: len(kv[0])):
            if all(any(pair <= p for p in parts) for pair in real):
                return axes
        return frozenset({"?"})
    for axes, parts in partitions.items():
        if real == parts:
            return axes
    return frozenset({"?"})


def collectives(hlo: str, mesh: Mesh) -> list[Collective]:
    partitions = axis_partitions(mesh)
    found, computation = [], ""
    for line in hlo.splitlines():
        if (h := _HEADER.match(line)) is not None and line.rstrip().endswith("{"):
            computation = h.group(1)
            continue
        if (m := _OP.match(line)) is None:
            continue
        shape, kind = m.group(1), m.group(2)
        operands = tuple(re.findall(r"[a-z]+\d*\[[\d,]*\]", shape))
        if kind in ("all-gather", "all-reduce", "collective-permute") and "-start(" in line and len(operands) > 1:
            operands = operands[len(operands) // 2:]  # async start: (operands, results)
        groups = _groups(line)
        axes = frozenset() if groups is None else _axes_of(groups, kind, partitions)
        found.append(Collective(kind, operands, axes, computation))
    return found


def loop_bodies(hlo: str) -> list[str]:
    """Names of the computations that are `while` bodies (a scanned stack: one iteration per layer)."""
    return re.findall(r"\bwhile\(.*?body=%([\w.\-]+)", hlo)


def per_layer(hlo: str, mesh: Mesh) -> list[Counter]:
    """For each while body: Counter of (kind, "+"-joined mesh axes) -> operands per iteration (collectives
    over groups of one device, which XLA sometimes leaves in, move nothing and are not counted)."""
    found = collectives(hlo, mesh)
    out = []
    for body in loop_bodies(hlo):
        counts = Counter()
        for c in found:
            if c.computation == body and c.axes:  # groups of one device move nothing
                counts[(c.kind, "+".join(sorted(c.axes)))] += len(c.operands)
        out.append(counts)
    return out
