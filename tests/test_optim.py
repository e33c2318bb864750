"""RowAdam must make exactly SparseAdam's updates (it only does them faster), and checkpoint like any optimizer."""

import copy

import pytest
import torch

from xmcbench.optim import RowAdam


def embeddings_pair():
    torch.manual_seed(0)
    first = torch.nn.Embedding(50, 8, sparse=True)
    second = torch.nn.Embedding(50, 8, sparse=True)
    second.load_state_dict(first.state_dict())
    return first, second


def step(embedding, optimizer, rows):
    optimizer.zero_grad(set_to_none=True)
    (embedding(rows) ** 2).sum().backward()
    optimizer.step()


def test_row_adam_makes_sparse_adams_updates():
    reference, ours = embeddings_pair()
    sparse_adam = torch.optim.SparseAdam(reference.parameters(), lr=1e-2)
    row_adam = RowAdam(ours.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(6):
        rows = torch.randint(0, 50, (4, 6), generator=generator)   # repeated rows: gradients add up
        step(reference, sparse_adam, rows)
        step(ours, row_adam, rows)
    # equal up to float rounding: SparseAdam adds eps before dividing by the bias correction, fused Adam after
    assert torch.allclose(reference.weight, ours.weight, atol=1e-5)
    assert not torch.equal(ours.weight, embeddings_pair()[0].weight)   # it did move


def test_row_adam_leaves_untouched_rows_and_resumes_from_its_state_dict():
    first, second = embeddings_pair()
    optimizer = RowAdam(first.parameters(), lr=1e-2)
    before = first.weight.detach().clone()
    step(first, optimizer, torch.tensor([[1, 2, 2]]))
    changed = (first.weight != before).any(dim=1)
    assert changed[[1, 2]].all() and not changed[[0, 3, 49]].any()

    resumed = RowAdam(second.parameters(), lr=1e-2)
    second.load_state_dict(first.state_dict())
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))   # as read back from a checkpoint
    for optimizer_, embedding in ((optimizer, first), (resumed, second)):
        step(embedding, optimizer_, torch.tensor([[2, 3]]))
    assert torch.equal(first.weight, second.weight)


def test_row_adam_refuses_dense_gradients():
    parameter = torch.nn.Parameter(torch.zeros(3, 2))
    parameter.grad = torch.ones(3, 2)
    with pytest.raises(RuntimeError, match="sparse gradients only"):
        RowAdam([parameter]).step()


def test_row_adam_under_a_grad_scaler_unscales_and_skips_on_the_device():
    reference, ours = embeddings_pair()
    plain = RowAdam(reference.parameters(), lr=1e-2)
    scaled = RowAdam(ours.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    rows = torch.tensor([[1, 2, 2], [4, 5, 1]])
    step(reference, plain, rows)
    scaled.zero_grad(set_to_none=True)
    scaler.scale((ours(rows) ** 2).sum()).backward()
    scaler.step(scaled)
    scaler.update()
    assert torch.allclose(reference.weight, ours.weight, atol=1e-6)   # unscaled by the kernel

    before, steps = ours.weight.detach().clone(), scaled.state[ours.weight]["step"].clone()
    scaled.zero_grad(set_to_none=True)
    scaler.scale((ours(rows) ** 2).sum() * float("inf")).backward()
    scaler.step(scaled)   # an inf gradient: the update is skipped and not counted
    scaler.update()
    assert torch.equal(ours.weight, before) and torch.equal(scaled.state[ours.weight]["step"], steps)
    assert scaler.get_scale() == 512.0
