"""Memory modes of actor.py: the bf16 AdamW that loses no small update (optim.strategy=adamw_bf16), on plain
tensors and on FSDP2 shards; offload of parameters and optimizer state between phases (worker.actor.offload.*),
a logged no-op on the CPU, moved for real on a GPU (skipped without CUDA)."""

import logging
import math
import multiprocessing
import os
import socket
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import actor as actor_module  # noqa: E402

STEPS, LR, SCALE, SHAPE = 200, 1e-6, 0.02, (256, 256)


def adamw_runs(weight_decay):
    """The same 200 random gradients (bf16, as FSDP hands them over) through (a) fp32-master torch AdamW, the
    reference; (b) AdamWBF16 on bf16 weights; (c) torch AdamW whose fp32 result is written back into bf16 weights
    after every step (the lossy way). -> (initial bf16 weights, reference, AdamWBF16 weights, their compensation, (c))."""
    gen = torch.Generator().manual_seed(0)
    w0 = (torch.randn(SHAPE, generator=gen) * SCALE).bfloat16()
    ref, lossy = torch.nn.Parameter(w0.float()), torch.nn.Parameter(w0.float())
    p = torch.nn.Parameter(w0.clone())
    opts = [torch.optim.AdamW([ref], lr=LR, weight_decay=weight_decay),
            actor_module.AdamWBF16([p], lr=LR, weight_decay=weight_decay),
            torch.optim.AdamW([lossy], lr=LR, weight_decay=weight_decay)]
    for _ in range(STEPS):
        g = torch.randn(SHAPE, generator=gen).bfloat16()
        for q in (ref, p, lossy):
            q.grad = g.to(q.dtype)
        for opt in opts:
            opt.step()
        with torch.no_grad():
            lossy.copy_(lossy.bfloat16().float())
    return w0.float(), ref.detach(), p.detach(), opts[1].state[p]["compensation"], lossy.detach()


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_adamw_bf16_keeps_the_updates_that_bf16_rounds_away(weight_decay):
    """200 steps of lr 1e-6 on bf16 weights of scale 0.02: each step (~1e-7) is far below half the bf16 spacing
    there (6e-5). The displacement that AdamWBF16 holds (weights + Kahan compensation c) is within 5% (relative L2)
    of fp32-master AdamW's, and 99% of its bf16 weights are the nearest bf16 of the fp32 weights (the best a bf16
    weight can be). Written back without compensation, the steps are lost: relative error ~1."""
    w0, ref, p, c, lossy = adamw_runs(weight_decay)
    moved = ref - w0
    assert moved.abs().mean() > 5e-6  # the reference did move (~1.2e-5 on average; 200 x lr is the most)
    held = p.float() + c.float() - w0
    error = ((held - moved).norm() / moved.norm()).item()
    assert error < 0.05, f"AdamWBF16 displacement differs from fp32 AdamW's by {error:.3f} (relative L2)"
    nearest = (p == ref.bfloat16()).float().mean().item()
    assert nearest > 0.99, f"only {nearest:.4f} of the bf16 weights are the nearest bf16 of the fp32 weights"
    lost = (((lossy - w0) - moved).norm() / moved.norm()).item()
    assert lost > 0.5, f"plain bf16 write-back was expected to lose the steps (relative error {lost:.3f})"


def test_adamw_bf16_state_is_bf16_and_fp32_weights_get_no_compensation():
    p32, p16 = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4, 3).bfloat16())
    opt = actor_module.AdamWBF16([p32, p16], lr=1e-3)
    for p in (p32, p16):
        p.grad = torch.ones_like(p)
    before = p32.detach().clone()
    opt.step()
    assert {opt.state[p][k].dtype for p in (p32, p16) for k in ("exp_avg", "exp_avg_sq", "compensation")} \
        == {torch.bfloat16}
    assert torch.all(opt.state[p32]["compensation"] == 0)
    # First step of Adam with g = 1: m / (1 - b1) = 1, v / (1 - b2) = 1, so p moves by lr / (1 + eps).
    torch.testing.assert_close(p32.detach(), before - 1e-3 / (1 + 1e-8), rtol=0, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# AdamWBF16 on FSDP2 shards (2 gloo ranks) = on the full tensors in one process
# ----------------------------------------------------------------------------------------------

def _sharded_adamw_main(rank, port, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = _tiny_model()
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        opt = actor_module.AdamWBF16(model.parameters(), lr=1e-3, weight_decay=0.1)
        _train(model, opt)
        state = opt.state[model.weight]
        assert all(isinstance(state[k], DTensor) for k in ("exp_avg", "exp_avg_sq", "compensation"))
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        comp = state["compensation"].full_tensor()
        if rank == 0:
            torch.save((full, comp), out_path)
    finally:
        dist.destroy_process_group()


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Linear(5, 7).bfloat16()  # 7 rows over 2 ranks: an uneven, padded shard


def _train(model, opt):
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(3, 5, generator=gen).bfloat16()
        model(x).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def test_adamw_bf16_on_fsdp2_shards_matches_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_sharded_adamw_main, args=(r, port, str(tmp_path / "out.pt"))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.time() + 120
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    assert [p.exitcode for p in procs] == [0, 0], f"rank exit codes {[p.exitcode for p in procs]}"
    full, comp = torch.load(tmp_path / "out.pt")
    model = _tiny_model()
    opt = actor_module.AdamWBF16(model.parameters(), lr=1e-3, weight_decay=0.1)
    _train(model, opt)
    for name, p in model.named_parameters():
        assert torch.equal(full[name], p.detach()), name
    assert torch.equal(comp, opt.state[model.weight]["compensation"])
