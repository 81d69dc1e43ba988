"""RoCE's lossless mode (PFC, IEEE 802.1Qbb): a congested egress pauses the links that feed it, and every flow
that shares a paused link slows down with the flows the egress was congested by (congestion spreading).

A flow-level approximation of the steady state, for greedy senders (no end-to-end congestion control: what
PFC alone does). Each flow is a path of directed links; every link ``u`` is one FIFO queue of one priority
class. Three rules:

- an egress link ``e`` serves the ports its flows arrive from in turn (round robin over input ports, the
  switch's arbitration): a port's share is the max-min fair share of ``e``'s capacity among the ports, given
  what each offers. A port is the link before ``e`` on the flow's path, or, at a flow's first link, the flow's
  own queue pair at the sender's NIC (which arbitrates among queue pairs the same way);
- a port that offers more than its share is paused (PFC) often enough that it sends exactly its share;
- a paused link is paused for everything queued on it: one FIFO holds the flows to ``e`` and the flows to
  elsewhere (the victims), so all of them are cut by the same factor, share / offered (head-of-line blocking;
  the mix on the link is the mix of what arrives). Its queue then fills and pauses the links that feed it, and
  theirs (the congestion tree): every flow on a link upstream of the paused one is cut by the same factor. A
  paused queue pair cuts only its flow.

Starting from every flow at its first link's capacity, the rules are applied link by link until no port offers
more than its share (rates only fall, so this converges); :func:`pfc_rates` returns the rates and, per link,
the share of its traffic the pauses held back. :func:`max_min_rates` is the lossy fabric's reference (a
congestion control that converges to max-min fairness, the simulator's fluid model).

What is validated: the small cases of ``tests/sim/test_pfc.py``, computed by hand (a victim that shares an
upstream link with flows into a congested egress runs at half its lossy rate, one switch further up too), and
that no link carries more than its capacity (a property test). What is only modelled: everything else, as this
machine has no RoCE NICs and no switch with PFC (the emulated clusters run TCP); the tail simulation does not
use these rates (its rate solver is max-min). Not modelled: per-priority pause classes, buffer headroom and the
pause's reaction time (transients), PFC deadlocks in cyclic buffer dependencies, DCQCN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from allreduce.topology import FloatArray

__all__ = ["PfcRates", "max_min_rates", "pfc_rates"]

# Relative change of every rate below which the rules have converged, and the most passes over the links.
_TOLERANCE = 1e-12
_MAX_PASSES = 10_000


@dataclass(frozen=True)
class PfcRates:
    """Per flow its rate (bytes/s) under PFC, and per link the share of what arrived for it that pauses held back
    (0: never paused)."""

    rates: FloatArray
    held_back: FloatArray


def _check(capacity: FloatArray, paths: Sequence[Sequence[int]]) -> None:
    if np.any(~np.isfinite(capacity)) or np.any(capacity <= 0):
        raise ValueError("pfc: every link's capacity must be a finite number > 0")
    for f, path in enumerate(paths):
        if not path:
            raise ValueError(f"pfc: flow {f} has an empty path")
        for link in path:
            if not 0 <= link < capacity.size:
                raise ValueError(f"pfc: flow {f} crosses link {link}, not one of the {capacity.size} links")


def _fair_shares(capacity: float, demands: FloatArray) -> FloatArray:
    """Max-min fair shares of ``capacity`` among ``demands`` (water-filling)."""
    shares = np.zeros(demands.size)
    left, open_ = capacity, np.ones(demands.size, dtype=np.bool_)
    while open_.any():
        level = left / int(open_.sum())
        small = open_ & (demands <= level)
        if not small.any():
            shares[open_] = level
            break
        shares[small] = demands[small]
        left -= float(demands[small].sum())
        open_ &= ~small
    return shares


def max_min_rates(capacity: FloatArray, paths: Sequence[Sequence[int]]) -> FloatArray:
    """The lossy fabric's rates: max-min fair over the links (progressive filling)."""
    capacity = np.asarray(capacity, dtype=np.float64)
    _check(capacity, paths)
    rates = np.zeros(len(paths))
    frozen = np.zeros(len(paths), dtype=np.bool_)
    left = capacity.copy()
    while not frozen.all():
        counts = np.zeros(capacity.size)
        for f, path in enumerate(paths):
            if not frozen[f]:
                np.add.at(counts, list(path), 1)
        used = counts > 0
        step = float(np.min(left[used] / counts[used]))
        for f, path in enumerate(paths):
            if not frozen[f]:
                rates[f] += step
                np.subtract.at(left, list(path), step)
        full = used & (left <= 1e-12 * capacity)
        for f, path in enumerate(paths):
            if not frozen[f] and full[list(path)].any():
                frozen[f] = True
    return rates


def _upstream(link: int, flows_on: list[list[int]], paths: Sequence[Sequence[int]]) -> set[int]:
    """``link`` and every link upstream of it: the links before it on its flows' paths, and theirs. Senders are
    greedy, so every queue is backlogged: a paused link's queue fills and pauses the links feeding it."""
    tree, todo = {link}, [link]
    while todo:
        u = todo.pop()
        for f in flows_on[u]:
            path = list(paths[f])
            hop = path.index(u)
            if hop and path[hop - 1] not in tree:
                tree.add(path[hop - 1])
                todo.append(path[hop - 1])
    return tree


def pfc_rates(capacity: FloatArray, paths: Sequence[Sequence[int]]) -> PfcRates:
    """The steady rates of greedy flows on ``paths`` (directed link indices, in hop order) over links of
    ``capacity`` (bytes/s) in a lossless fabric whose congested egresses pause their inputs (see the module
    docstring)."""
    capacity = np.asarray(capacity, dtype=np.float64)
    _check(capacity, paths)
    flows_on: list[list[int]] = [[] for _ in range(capacity.size)]
    # per link, its flows with the port each arrives from: the link before, or -1 - f for flow f's queue pair
    ports_at: list[list[tuple[int, int]]] = [[] for _ in range(capacity.size)]
    for f, path in enumerate(paths):
        for hop, link in enumerate(path):
            flows_on[link].append(f)
            ports_at[link].append((f, path[hop - 1] if hop else -1 - f))
    rates = np.array([capacity[path[0]] for path in paths], dtype=np.float64)
    cut = np.ones(capacity.size)  # per link, the product of the factors it was paused by
    for _ in range(_MAX_PASSES):
        before = rates.copy()
        for link in range(capacity.size):
            if not ports_at[link]:
                continue
            ports = sorted({port for _, port in ports_at[link]})
            offered = np.zeros(len(ports))
            for f, port in ports_at[link]:
                offered[ports.index(port)] += rates[f]
            share = _fair_shares(float(capacity[link]), offered)
            for i, port in enumerate(ports):
                if offered[i] <= share[i] * (1 + _TOLERANCE):
                    continue
                factor = share[i] / offered[i]
                if port >= 0:  # a link paused: everything queued on it, the victims too, and upstream of it
                    tree = _upstream(port, flows_on, paths)
                    rates[sorted({f for u in tree for f in flows_on[u]})] *= factor
                    cut[sorted(tree)] *= factor
                else:  # a queue pair paused at its NIC
                    rates[-1 - port] *= factor
        if np.all(np.abs(rates - before) <= _TOLERANCE * np.maximum(before, 1e-300)):
            break
    return PfcRates(rates, 1.0 - cut)
