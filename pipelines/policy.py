"""The Scale-aware AutoAugment policy: a flat list of integer genes and its decoded form.

The policy is stored as a flat list of integers 0..9 so that a search can mutate and cross it
over gene by gene (``AUTOAUG.LIST`` in the original). With ``n`` sub-policies it holds
``4 + 6 * n + 6`` genes:

====================  ============================================================
positions             meaning
====================  ============================================================
0, 1                  zoom_out: probability = gene * 0.05, level = gene
2, 3                  zoom_in: probability = gene * 0.05, level = gene
4 + 6i .. 9 + 6i      sub-policy i: color op ``COLOR_OPS[g mod 7]``, prob g * 0.1, level g;
                      geometric op ``GEO_OPS[g mod 6]``, prob g * 0.1, level g
4 + 6n .. 6 + 6n      ``area`` ratios (small, medium, large): color box selection and blend size
7 + 6n .. 9 + 6n      ``prob`` ratios (small, medium, large): geometric box selection
====================  ============================================================
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from .errors import ConfigError

_Entry = TypeVar("_Entry")

# The order matters: op genes are taken modulo the length of these tuples, so appending or reordering an
# op re-means every stored policy (PUBLISHED_POLICY included); tests/test_policy.py pins both lists.
COLOR_OPS = ("AutoContrast", "Equalize", "SolarizeAdd", "Color", "Contrast", "Brightness", "Sharpness")
GEO_OPS = ("hflip", "rotate", "shearX", "shearY", "translateX", "translateY")

# The searched policy of the paper (5 sub-policies).
PUBLISHED_POLICY: tuple[int, ...] = (
    6, 9, 5, 3,
    3, 4, 2, 4, 4, 4,
    5, 2, 4, 1, 4, 2,
    6, 4, 2, 2, 2, 6,
    2, 2, 2, 0, 5, 1,
    3, 0, 8, 5, 2, 8,
    7, 5, 1, 3, 3, 3,
)

MAX_GENE = 9
_KEY = "augment.policy"


@dataclass(frozen=True)
class ZoomOp:
    """An image-level zoom: fires with ``prob``; ``level`` (0..9) indexes the zoom ratio table, or is ``None``:
    drawn uniformly 0..9 each time the zoom fires (TrivialAugment's magnitude; no gene decodes to it)."""

    prob: float
    level: int | None


@dataclass(frozen=True)
class BoxOp:
    """A box-level op ``name`` (one of ``COLOR_OPS`` or ``GEO_OPS``) with its probability and level."""

    name: str
    prob: float
    level: int


@dataclass(frozen=True)
class SubPolicy:
    """One color op then one geometric op, applied to the boxes of one image."""

    color: BoxOp
    geometric: BoxOp


@dataclass(frozen=True)
class Policy:
    """A decoded policy.

    ``area_ratios`` weight the selection of small / medium / large boxes by color ops and size
    their blend regions; ``prob_ratios`` weight the selection by geometric ops.
    """

    zoom_out: ZoomOp
    zoom_in: ZoomOp
    subpolicies: tuple[SubPolicy, ...]
    area_ratios: tuple[int, int, int]
    prob_ratios: tuple[int, int, int]

    def __str__(self) -> str:
        """The policy in words, one line per op (as logged and stored with each run)."""

        def op(o: BoxOp) -> str:
            return f"{o.name} p={o.prob:.1f} level={o.level}"

        def zoom_level(z: ZoomOp) -> str:
            return f"uniform 0..{MAX_GENE}" if z.level is None else str(z.level)

        lines = [f"Scale-aware AutoAugment policy ({len(self.subpolicies)} sub-policies)",
                 f"  zoom_out: p={self.zoom_out.prob:.2f} level={zoom_level(self.zoom_out)}",
                 f"  zoom_in:  p={self.zoom_in.prob:.2f} level={zoom_level(self.zoom_in)}"]
        lines += [f"  sub-policy {i}: {op(sub.color)}, then {op(sub.geometric)}"
                  for i, sub in enumerate(self.subpolicies)]
        lines.append("  area ratios (small, medium, large): " + ", ".join(map(str, self.area_ratios)))
        lines.append("  prob ratios (small, medium, large): " + ", ".join(map(str, self.prob_ratios)))
        return "\n".join(lines)


def trivial_policy() -> Policy:
    """TrivialAugment (Müller and Hutter, ICCV 2021) over this policy's box-level ops, as a :class:`Policy`.

    Per image one op, drawn uniformly among ``COLOR_OPS + GEO_OPS``, at a level drawn uniformly 0..9, always
    applied: one sub-policy per (op, level) whose one op has probability 1 (the other 0), so that drawing a
    sub-policy uniformly, as the transform does, draws the op and the level uniformly. No zoom, and equal
    ratios for every scale: nothing is searched or tuned.
    """
    levels = range(MAX_GENE + 1)
    off_color, off_geometric = BoxOp(COLOR_OPS[0], 0.0, 0), BoxOp(GEO_OPS[0], 0.0, 0)
    subpolicies = [SubPolicy(color=BoxOp(name, 1.0, level), geometric=off_geometric)
                   for name in COLOR_OPS for level in levels]
    subpolicies += [SubPolicy(color=off_color, geometric=BoxOp(name, 1.0, level)) for name in GEO_OPS for level in levels]
    return Policy(zoom_out=ZoomOp(0.0, 0), zoom_in=ZoomOp(0.0, 0), subpolicies=tuple(subpolicies),
                  area_ratios=(1, 1, 1), prob_ratios=(1, 1, 1))


def trivial_zoom_policy() -> Policy:
    """:func:`trivial_policy` after a uniform zoom, TrivialAugment's rule applied to the image-level zoom too: per
    image zoom_out, zoom_in or no zoom, one third each (one draw, as every policy's zoom), at a level drawn
    uniformly 0..9 (a zoom ratio of 0.95..0.5 out, 1.05..1.5 in); then the one box-level op. Nothing searched."""
    uniform = ZoomOp(1 / 3, None)
    return dataclasses.replace(trivial_policy(), zoom_out=uniform, zoom_in=uniform)


def op_table(ops: tuple[str, ...], entries: dict[str, _Entry]) -> dict[str, _Entry]:
    """``entries`` (op name -> its implementation) unchanged, once its names are checked to be ``ops``
    (:data:`COLOR_OPS` or :data:`GEO_OPS`), in order. Each module that implements ops declares them through
    this, so an op named here but not implemented there (or the reverse) is a bug raised when the module is
    imported, not an op that silently does nothing."""
    if tuple(entries) != ops:
        raise AssertionError(f"op table {tuple(entries)} differs from pipelines.policy's {ops}")
    return entries


def policy_length(n_subpolicies: int) -> int:
    """How many genes a policy with ``n_subpolicies`` sub-policies has."""
    return 4 + 6 * n_subpolicies + 6


def _check_genes(genes: Sequence[int], n_subpolicies: int) -> list[int]:
    if isinstance(n_subpolicies, bool) or not isinstance(n_subpolicies, numbers.Integral) or n_subpolicies < 1:
        raise ConfigError(f"augment.n_subpolicies: expected a positive integer, got {n_subpolicies!r}")
    if isinstance(genes, (str, bytes)) or not isinstance(genes, Sequence) and not hasattr(genes, "__iter__"):
        raise ConfigError(f"{_KEY}: expected a list of integers 0..{MAX_GENE}, got {type(genes).__name__}")
    try:
        genes = list(genes)
    except TypeError:  # iterable in name only, e.g. a 0-d numpy array
        raise ConfigError(f"{_KEY}: expected a list of integers 0..{MAX_GENE}, got {type(genes).__name__}") from None
    expected = policy_length(n_subpolicies)
    if len(genes) != expected:
        raise ConfigError(f"{_KEY}: expected {expected} genes for {n_subpolicies} sub-policies "
                          f"(4 + 6 * {n_subpolicies} + 6), got {len(genes)}")
    for i, gene in enumerate(genes):
        # bool is an int subclass and 3.0 compares equal to 3: neither is a gene a search would write.
        if isinstance(gene, bool) or not isinstance(gene, numbers.Integral) or not 0 <= gene <= MAX_GENE:
            raise ConfigError(f"{_KEY}[{i}]: expected an integer 0..{MAX_GENE}, got {gene!r}")
    return [int(g) for g in genes]


def decode_policy(genes: Sequence[int], n_subpolicies: int = 5) -> Policy:
    """Decode a flat gene list (see the module docstring) into a :class:`Policy`.

    Raises:
        ConfigError: wrong length, or a gene that is not an integer 0..9 (the message names its position).
    """
    g = _check_genes(genes, n_subpolicies)
    subpolicies = []
    for i in range(n_subpolicies):
        c = 4 + 6 * i
        color = BoxOp(name=COLOR_OPS[g[c] % len(COLOR_OPS)], prob=g[c + 1] / 10, level=g[c + 2])
        geometric = BoxOp(name=GEO_OPS[g[c + 3] % len(GEO_OPS)], prob=g[c + 4] / 10, level=g[c + 5])
        subpolicies.append(SubPolicy(color=color, geometric=geometric))
    r = 4 + 6 * n_subpolicies
    # gene / 20 and gene / 10 give the nearest doubles to 0.05 * gene and 0.1 * gene (6 * 0.05 does not).
    return Policy(
        zoom_out=ZoomOp(prob=g[0] / 20, level=g[1]),
        zoom_in=ZoomOp(prob=g[2] / 20, level=g[3]),
        subpolicies=tuple(subpolicies),
        area_ratios=(g[r], g[r + 1], g[r + 2]),
        prob_ratios=(g[r + 3], g[r + 4], g[r + 5]),
    )
