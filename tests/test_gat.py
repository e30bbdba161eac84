"""rlflow.nn.gat against PyTorch Geometric, which the encoder used before: the same parameters from the same seed,
the same outputs and gradients on random graphs (so checkpoints written with PyG load and behave as before), and
the batching of rlflow.nn.graph_data against PyG's ``Batch``. PyG is a test requirement only."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.nn.gat import GATv2, scatter_mean, scatter_sum, segment_softmax
from rlflow.nn.graph_data import GraphData, batch

@pytest.fixture(scope="module")
def pyg_nn():
    """PyTorch Geometric's layers, imported by the tests that compare with them (not at collection: both
    pytest-xdist workers collect every file, and PyG takes seconds to import)."""
    return pytest.importorskip("torch_geometric.nn")


def random_graph(seed: int, nodes: int, edges: int, features: int, edge_dim: int):
    """Random features and edges (self-loops, repeated edges and nodes nothing enters included)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(nodes, features, generator=g)
    edge_index = torch.randint(0, nodes, (2, edges), generator=g)
    edge_attr = torch.randn(edges, edge_dim, generator=g)
    return x, edge_index, edge_attr


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), nodes=st.integers(1, 12), edges=st.integers(0, 30), heads=st.integers(1, 4),
       per_head=st.integers(1, 6), concat=st.booleans())
def test_gatv2_equals_pygs_gatv2conv(pyg_nn, seed, nodes, edges, heads, per_head, concat):
    features, edge_dim = 5, 3
    torch.manual_seed(seed)
    ref = pyg_nn.GATv2Conv(features, per_head, heads=heads, concat=concat, edge_dim=edge_dim, add_self_loops=True)
    torch.manual_seed(seed)
    own = GATv2(features, per_head, heads, concat, edge_dim)
    ref_state, own_state = ref.state_dict(), own.state_dict()
    assert list(own_state) == list(ref_state)
    for k in ref_state:  # the same draws: equal to the bit
        assert torch.equal(own_state[k], ref_state[k]), k
    x, edge_index, edge_attr = random_graph(seed, nodes, edges, features, edge_dim)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref(xa, edge_index, edge_attr)
    out_own = own(xb, edge_index, edge_attr)
    assert out_own.shape == out_ref.shape == (nodes, heads * per_head if concat else per_head)
    torch.testing.assert_close(out_own, out_ref, rtol=1e-5, atol=1e-6)
    out_ref.square().sum().backward()
    out_own.square().sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)
    for (name, p_own), (_, p_ref) in zip(own.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p_own.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_checkpoint_of_pygs_layer_loads_and_computes_the_same(pyg_nn):
    torch.manual_seed(3)
    ref = pyg_nn.GATv2Conv(8, 4, heads=2, concat=True, edge_dim=8, add_self_loops=True)
    torch.manual_seed(99)  # other weights, then the PyG layer's state loaded over them
    own = GATv2(8, 4, 2, True, 8)
    own.load_state_dict(ref.state_dict())
    x, edge_index, edge_attr = random_graph(7, 9, 20, 8, 8)
    torch.testing.assert_close(own(x, edge_index, edge_attr), ref(x, edge_index, edge_attr), rtol=1e-5, atol=1e-6)


def test_scatter_reductions_by_hand():
    src = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    index = torch.tensor([2, 0, 2])
    assert scatter_sum(src, index, 4).tolist() == [[3, 4], [0, 0], [6, 8], [0, 0]]
    assert scatter_mean(src, index, 4).tolist() == [[3, 4], [0, 0], [3, 4], [0, 0]]
    w = segment_softmax(torch.tensor([[0.0], [5.0], [0.0]]), index, 4)
    assert w.tolist() == [[0.5], [1.0], [0.5]]  # the two entries of group 2 share it; group 0 has one


def test_batch_equals_pygs_batch(pyg_nn):
    from torch_geometric.data import Batch, Data

    datas = []
    for i, (nodes, edges) in enumerate(((3, 2), (1, 0), (4, 5))):
        x, edge_index, edge_attr = random_graph(i, nodes, edges, 6, 2)
        datas.append(GraphData(x, edge_index, edge_attr, torch.randn(1, 4), torch.randn(1, 4), torch.randn(1, 7)))
    own = batch(datas)
    ref = Batch.from_data_list([Data(**vars(d)) for d in datas])
    for name in ("x", "edge_index", "edge_attr", "u", "y_metrics", "y_counts", "batch"):
        assert torch.equal(getattr(own, name), getattr(ref, name)), name
    assert own.num_graphs == ref.num_graphs == 3
    assert batch(datas[:1] + [GraphData(*datas[1].__dict__.values())]).y_metrics is not None
    no_targets = batch([GraphData(d.x, d.edge_index, d.edge_attr, d.u) for d in datas])
    assert no_targets.y_metrics is None and no_targets.to("cpu").x.shape == own.x.shape
