"""Peak live tensor bytes on the CPU (profilers.tensor_memory), what rlplace run reports as memory."""

from __future__ import annotations

import torch
import torch.nn as nn

from profilers.tensor_memory import LiveTensorBytes, state_tensors


def test_counts_state_then_the_step_and_frees_what_is_collected():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 256)
    params = sum(p.numel() for p in model.parameters()) * 4
    tracker = LiveTensorBytes().track([*state_tensors(model, opt), x])
    assert tracker.current == params + x.numel() * 4
    with tracker:
        model(x).sum().backward()
        opt.step()
        big = torch.empty(4 * 2**20, dtype=torch.uint8)
        at_big = tracker.current
        del big
    assert tracker.current == at_big - 4 * 2**20  # freed when collected
    # at the buffer: weights, their gradients, the input and the 4 MiB (the activations are gone)
    assert tracker.peak == 2 * params + x.numel() * 4 + 4 * 2**20
    assert tracker.current >= 2 * params  # the gradients stay alive after the step


def test_views_share_their_storage_and_do_not_count_twice():
    tracker = LiveTensorBytes()
    with tracker:
        a = torch.zeros(1024)
        b = a[:512].view(2, 256)
        c = a.t() if a.dim() == 2 else a.unsqueeze(0)
    assert tracker.peak == 1024 * 4 and b.numel() == 512 and c.shape == (1, 1024)


def test_optimizer_state_is_part_of_the_starting_state():
    model = nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    tracker = LiveTensorBytes().track(state_tensors(model, opt))
    n = sum(p.numel() for p in model.parameters())
    # weights, gradients and Adam's two moments (fp32), plus its step counters
    assert tracker.current >= 4 * n * 4
