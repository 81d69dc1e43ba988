"""Spec strings and topology files: what they build, and errors naming the file, line and names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from allreduce.topology import NodeKind, load_topology, parse_topology, route

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "topologies" / "two_racks.yaml"


@pytest.mark.parametrize(
    ("spec", "gpus", "name"),
    [
        ("fat-tree:k=16,bw=400Gbps,lat=1us", 1024, "fat-tree:k=16,bw=400Gbps,lat=1us"),
        ("fat_tree:8", 128, "fat-tree:k=8,bw=400Gbps,lat=1us"),
        ("clos:leaves=32,spines=16,hosts_per_leaf=16,oversub=4", 512, None),
        ("clos:leaves=4,spines=4,hosts=2,cores=4,pods=2,oversub=2:1", 8, None),
        ("rail:nodes=128,gpus=8,nvlink=900GB/s,nic=400Gbps", 1024, None),
        ("torus:8x8x8,bw=100GB/s", 512, "torus:8x8x8,bw=100GB/s,lat=1us"),
        ("dragonfly:groups=9,routers=4,hosts=2", 72, None),
        ("switch:64,bw=200Gbps", 64, "switch:64,bw=200Gbps,lat=1us"),
        ("ring:8", 8, None),
        ("full:8", 8, None),
        ("rail:nodes=2,gpus=4,mesh", 8, None),
    ],
)
def test_spec_strings_build_what_they_say(spec: str, gpus: int, name: str | None) -> None:
    t = parse_topology(spec)
    assert t.num_gpus == gpus
    if name is not None:
        assert t.name == name


def test_spec_units_reach_the_links() -> None:
    t = parse_topology("rail:nodes=2,gpus=2,nvlink=900GB/s,nic=200Gbps,lat=2us")
    assert t.link_bandwidth_Bps[t.find_link("gpu1->nvs0")] == 900e9
    assert t.link_bandwidth_Bps[t.find_link("nic1->rail1")] == 25e9
    assert t.link_latency_s[t.find_link("nic1->rail1")] == 2e-6
    c = parse_topology("clos:leaves=2,spines=1,hosts=4,oversub=4,bw=100GB/s")
    assert c.link_bandwidth_Bps[c.find_link("leaf0->spine0")] == pytest.approx(100e9)  # 4 × 100 / 4


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("hypercube:4", "unknown kind 'hypercube'"),
        ("fat-tree:k=16,speed=1", "unknown parameter 'speed'; parameters are k, bw, lat"),
        ("fat-tree:k=sixteen", "k='sixteen' is not an integer"),
        ("fat-tree:k=16,bw=fast", "cannot read 'fast' as a bandwidth"),
        ("fat-tree:k=7", "k must be even"),
        ("clos:leaves=4,spines=2", "missing hosts_per_leaf"),
        ("torus:8xx8", "is not dimensions like 8x8x8"),
        ("switch:4,lat=3 parsecs", "cannot read '3 parsecs' as a time"),
        ("ring:4,n=5", "n is given twice"),
        ("clos:leaves=2,spines=2,hosts=2,oversub=4:0", "is not a number or a ratio"),
        ("", "expected a spec"),
        ("missing.yaml", "missing.yaml: cannot read topology file"),
    ],
)
def test_bad_specs_get_one_line_naming_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_topology(spec)
    assert "\n" not in str(info.value)


def test_example_file_loads_and_routes_over_nvlink_inside_a_server() -> None:
    t = parse_topology(str(EXAMPLE))
    assert t.name == "two-racks"
    assert t.num_gpus == 8
    assert int(np.count_nonzero(t.node_kind == NodeKind.NIC)) == 8
    # asymmetric uplink
    assert t.link_bandwidth_Bps[t.find_link("tor0->spine0")] == 100e9
    assert t.link_bandwidth_Bps[t.find_link("spine0->tor0")] == 200e9
    r = route(t, [0, 0], [1, 4])
    assert [t.link_name(int(i)) for i in r.links_of(0)] == ["gpu0->nvs0", "nvs0->gpu1"]
    assert r.links_of(1).size == 6


def write(tmp_path: Path, text: str, suffix: str = ".yaml") -> str:
    path = tmp_path / f"topo{suffix}"
    path.write_text(text)
    return str(path)


GOOD = """\
nodes:
  - {name: a, kind: gpu}
  - {name: b, kind: gpu}
  - {name: sw, kind: switch}
links:
  - {src: a, dst: sw, bandwidth: 100Gbps, latency: 1us}
  - {src: sw, dst: b, bandwidth: 10GB/s, reverse_bandwidth: 5GB/s, latency: 2us, reverse_latency: 3us}
"""


def test_asymmetric_file_links(tmp_path: Path) -> None:
    t = load_topology(write(tmp_path, GOOD))
    assert t.name == "topo"
    assert t.num_links == 4
    assert t.link_bandwidth_Bps[t.find_link("a->sw")] == 12.5e9
    assert t.link_bandwidth_Bps[t.find_link("sw->b")] == 10e9
    assert t.link_bandwidth_Bps[t.find_link("b->sw")] == 5e9
    assert t.link_latency_s[t.find_link("b->sw")] == 3e-6
    r = route(t, [0, 1], [1, 0])
    np.testing.assert_allclose(r.latency_s, [3e-6, 4e-6])


def test_json_file_with_a_one_way_link(tmp_path: Path) -> None:
    doc = {
        "name": "triangle",
        "gpu_transit": True,
        "defaults": {"bandwidth": "1GB/s"},
        "nodes": [{"name": f"g{i}", "kind": "gpu"} for i in range(3)],
        "links": [
            {"src": "g0", "dst": "g1", "directed": True},
            {"src": "g1", "dst": "g2", "directed": True},
            {"src": "g2", "dst": "g0", "directed": True},
        ],
    }
    t = load_topology(write(tmp_path, json.dumps(doc, indent=2), ".json"))
    assert t.num_links == 3
    r = route(t, [1], [0])  # only one way round: g1 -> g2 -> g0
    assert [t.link_name(int(i)) for i in r.links_of(0)] == ["g1->g2", "g2->g0"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (GOOD.replace("dst: b, bandwidth", "dst: c, bandwidth"), r"topo.yaml:7: link sw->c: unknown node 'c'"),
        (
            GOOD + "  - {src: b, dst: sw, bandwidth: 1GB/s}\n",
            r"topo.yaml:8: duplicate link b->sw \(already defined at line 7\)",
        ),
        (GOOD.replace("100Gbps", "100 parsecs"), r"topo.yaml:6: link a->sw: bandwidth: cannot read '100 parsecs'"),
        (GOOD.replace("latency: 1us", "latency: soon"), r"topo.yaml:6: link a->sw: latency: cannot read 'soon'"),
        (GOOD.replace("{name: b, kind: gpu}", "{name: a, kind: gpu}"), r"topo.yaml:3: node a defined twice"),
        (GOOD.replace("kind: switch", "kind: router"), r"topo.yaml:4: node sw: kind must be one of gpu, nic, switch"),
        (GOOD.replace("{src: a, dst: sw,", "{src: a, dst: a,"), r"topo.yaml:6: link a->a connects a node to itself"),
        (GOOD.replace("latency: 1us}", "latency: 1us, colour: red}"), r"topo.yaml:6: link: unknown key 'colour'"),
        (GOOD + "extras: 1\n", r"topo.yaml:8: topology: unknown key 'extras'"),
        (GOOD.replace("bandwidth: 100Gbps, ", ""), r"topo.yaml:6: link a->sw: no bandwidth"),
        (GOOD.replace("100Gbps", "12500000000"), r"topo.yaml:6: link a->sw: bandwidth: 12500000000 has no unit"),
        (GOOD.replace("latency: 1us", "latency: 0.000001"), r"topo.yaml:6: link a->sw: latency: 1e-06 has no unit"),
        (
            "defaults: {bandwidth: 100, latency: 1us}\n" + GOOD,
            r"topo.yaml:1: defaults: bandwidth: 100 has no unit",
        ),
        ("nodes: [\n", r"topo.yaml:2: not valid YAML"),
        ("- 1\n- 2\n", r"topo.yaml:1: a topology file is a mapping"),
        ("nodes: []\nlinks: []\n", r"topo.yaml:1: 'nodes' must be a non-empty list"),
        (
            GOOD.replace(
                "{src: sw, dst: b, bandwidth: 10GB/s, reverse_bandwidth: 5GB/s,",
                "{src: b, dst: sw, directed: true, bandwidth: 1GB/s,",
            ).replace(", reverse_latency: 3us", ""),
            r"topo.yaml:3: no path from a \(line 2\) to b \(line 3\)",
        ),
    ],
)
def test_bad_files_name_file_line_and_names(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        load_topology(write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_unreachable_gpu_pair_in_a_file_is_named(tmp_path: Path) -> None:
    text = """\
nodes:
  - {name: a, kind: gpu}
  - {name: b, kind: gpu}
  - {name: c, kind: gpu}
  - {name: s1, kind: switch}
  - {name: s2, kind: switch}
links:
  - {src: a, dst: s1, bandwidth: 1GB/s}
  - {src: b, dst: s1, bandwidth: 1GB/s}
  - {src: c, dst: s2, bandwidth: 1GB/s}
"""
    with pytest.raises(ValueError, match=r"topo.yaml:4: no path from a \(line 2\) to c \(line 4\); 3 more GPU pairs"):
        load_topology(write(tmp_path, text))
    # a GPU chain is not a path unless GPUs forward
    chain = "nodes:\n" + "".join(f"  - {{name: g{i}, kind: gpu}}\n" for i in range(3))
    chain += "links:\n  - {src: g0, dst: g1, bandwidth: 1GB/s}\n  - {src: g1, dst: g2, bandwidth: 1GB/s}\n"
    with pytest.raises(ValueError, match=r"no path from g0 \(line 2\) to g2 \(line 4\).*gpu_transit: true"):
        load_topology(write(tmp_path, chain))
    assert load_topology(write(tmp_path, "gpu_transit: true\n" + chain)).num_links == 4


def test_invalid_json_names_its_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"topo.json:3: not valid JSON"):
        load_topology(write(tmp_path, '{\n  "nodes": [],\n  "links": [,]\n}', ".json"))


def test_json_errors_name_the_line_of_the_culprit(tmp_path: Path) -> None:
    doc = {
        "nodes": [{"name": "a", "kind": "gpu"}, {"name": "s", "kind": "switch"}],
        "links": [{"src": "a", "dst": "s", "bandwidth": "1GB/s"}, {"src": "s", "dst": "b", "bandwidth": "1GB/s"}],
    }
    text = json.dumps(doc, indent=2)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if '"dst": "b"' in row)
    with pytest.raises(ValueError, match=rf"topo.json:{line - 2}: link s->b: unknown node 'b'"):
        load_topology(write(tmp_path, text, ".json"))


def test_yaml_key_given_twice(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"topo.yaml:2: key 'kind' given twice \(first at line 2\)"):
        load_topology(write(tmp_path, "nodes:\n  - {name: a, kind: gpu, kind: nic}\nlinks: []\n"))


def test_the_example_file_points_to_the_public_format_document() -> None:
    root = Path(__file__).resolve().parents[2]
    example = (root / "examples" / "topologies" / "two_racks.yaml").read_text()
    assert "docs/topology-files.md" in example
    assert "allreduce.topology._files" not in example
    doc = (root / "docs" / "topology-files.md").read_text()
    for key in ("gpu_transit", "defaults", "reverse_bandwidth", "reverse_latency", "directed"):
        assert key in doc


def test_one_more_unreachable_pair_is_called_a_pair(tmp_path: Path) -> None:
    text = """\
nodes:
  - {name: a, kind: gpu}
  - {name: b, kind: gpu}
  - {name: c, kind: gpu}
  - {name: sw, kind: switch}
links:
  - {src: a, dst: sw, bandwidth: 1GB/s}
  - {src: b, dst: sw, bandwidth: 1GB/s}
  - {src: sw, dst: c, bandwidth: 1GB/s, directed: true}
"""
    with pytest.raises(ValueError, match=r"no path from c .*; 1 more GPU pair has no path either") as info:
        load_topology(write(tmp_path, text))
    assert "pairs" not in str(info.value)
