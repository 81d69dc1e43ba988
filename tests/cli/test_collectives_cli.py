"""``explain`` and ``sim`` with ``--collective``: all-to-all, gather and scatter schedules against closed forms."""

from __future__ import annotations

import json
import math

import pytest

from allreduce.cli import main

MiB = 1 << 20
LINK_Bps = 50e9  # 400 Gb/s
ALPHA_S = 5e-6


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data: dict[str, object] = json.loads(out)
    return data


def _seconds(data: dict[str, object]) -> dict[str, float]:
    algorithms = data["algorithms"]
    assert isinstance(algorithms, list)
    return {a["name"]: a["seconds"] for a in algorithms}


def _explain(capsys: pytest.CaptureFixture[str], collective: str, ranks: int, size: int) -> dict[str, object]:
    return _json(
        capsys, "explain", "--ranks", str(ranks), "--size", str(size), "--bandwidth", "400Gbps", "--latency", "5us",
        "--collective", collective,
    )  # fmt: skip


@pytest.mark.parametrize("ranks", [4, 8, 16])
def test_explain_all_to_all_matches_the_closed_forms_and_bruck_beats_pairwise_only_small(
    capsys: pytest.CaptureFixture[str], ranks: int
) -> None:
    for size, faster in ((1024, "bruck"), (64 * MiB, "pairwise")):
        data = _explain(capsys, "all_to_all", ranks, size)
        assert data["collective"] == "all_to_all"
        seconds = _seconds(data)
        # pairwise: N-1 steps, each a permutation of parts of S/N; Bruck: log2 N steps of half the buffer each;
        # direct: one step of every part (the model charges no incast, so it is fastest at every size)
        assert seconds["pairwise"] == pytest.approx((ranks - 1) * (ALPHA_S + size / ranks / LINK_Bps))
        assert seconds["bruck"] == pytest.approx(math.log2(ranks) * (ALPHA_S + size / 2 / LINK_Bps))
        assert seconds["direct"] == pytest.approx(ALPHA_S + (ranks - 1) / ranks * size / LINK_Bps)
        assert data["best"] == "direct"
        assert min(("bruck", "pairwise"), key=seconds.__getitem__) == faster


@pytest.mark.parametrize("collective", ["gather", "scatter"])
def test_explain_gather_and_scatter_charge_the_root_its_whole_buffer(
    capsys: pytest.CaptureFixture[str], collective: str
) -> None:
    ranks, size = 8, 8 * MiB
    seconds = _seconds(_explain(capsys, collective, ranks, size))
    through_root = (ranks - 1) / ranks * size / LINK_Bps  # the root's link carries every other rank's block
    assert seconds["direct"] == pytest.approx(ALPHA_S + through_root)
    assert seconds["binomial"] == pytest.approx(math.log2(ranks) * ALPHA_S + through_root)


def test_explain_names_an_algorithm_of_another_collective_as_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["explain", "-n", "4", "--size", "1MiB", "--bandwidth", "1Gbps", "--latency", "1us",
                 "-c", "all_to_all", "-a", "ring"])  # fmt: skip
    _, err = capsys.readouterr()
    assert code == 2
    assert "unknown all-to-all algorithm 'ring'; choose one of pairwise, direct, bruck" in err


def test_sim_runs_pairwise_all_to_all_on_a_ring_as_its_hop_count_says(capsys: pytest.CaptureFixture[str]) -> None:
    n, size, hop_latency_s = 8, 64 * MiB, 1e-6
    data = _json(capsys, "sim", "--topology", f"ring:{n},bw=400Gbps,lat=1us", "--size", "64MiB",
                 "-c", "all_to_all", "-a", "pairwise")  # fmt: skip
    assert data["collective"] == "all_to_all"
    # step k sends every rank's part for rank r+k the short way round, min(k, N-k) hops: each link carries that
    # many parts of S/N at once, and the step's latency is that many hops
    expected = sum(min(k, n - k) * (size / n / LINK_Bps + hop_latency_s) for k in range(1, n))
    (pairwise,) = data["algorithms"]  # type: ignore[misc]
    assert pairwise["seconds"] == pytest.approx(expected, rel=1e-6)
    assert pairwise["busbw_GBps"] == pytest.approx(size / expected * (n - 1) / n / 1e9, rel=1e-6)


def test_sim_refuses_mitigate_for_another_collective(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sim", "--topology", "ring:4", "--size", "1MiB", "-c", "gather", "--mitigate"])
    _, err = capsys.readouterr()
    assert code == 2
    assert "--mitigate re-plans the all-reduce ring; it does not apply to --collective gather" in err
