"""Memory modes of actor.py: the bf16 AdamW that loses no small update (optim.strategy=adamw_bf16), on plain
tensors and on FSDP2 shards; offload of parameters and optimizer state between phases (worker.actor.offload.*),
a logged no-op on the CPU (the mechanism forced on over two gloo ranks), moved for real on a GPU (skipped without
CUDA)."""

import logging
import math
import os
import socket
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import actor as actor_module  # noqa: E402
import modeling  # noqa: E402
from conftest import leave_rank, run_ranks  # noqa: E402

STEPS, LR, SCALE, SHAPE = 200, 1e-6, 0.02, (256, 256)


def adamw_runs(weight_decay):
    """The same 200 random gradients (bf16, as FSDP hands them over) through (a) fp32-master torch AdamW, the
    reference; (b) AdamWBF16 on bf16 weights; (c) torch AdamW whose fp32 result is written back into bf16 weights after
    every step (the lossy way). -> (initial bf16 weights, reference, AdamWBF16 weights, their compensation, (c))."""
    gen = torch.Generator().manual_seed(0)
    w0 = (torch.randn(SHAPE, generator=gen) * SCALE).bfloat16()
    ref, lossy = torch.nn.Parameter(w0.float()), torch.nn.Parameter(w0.float())
    p = torch.nn.Parameter(w0.clone())
    opts = [torch.optim.AdamW([ref], lr=LR, weight_decay=weight_decay),
            modeling.AdamWBF16([p], lr=LR, weight_decay=weight_decay),
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


@pytest.mark.parametrize("weight_decay", [0.0, 5.0])
def test_adamw_bf16_keeps_the_updates_that_bf16_rounds_away(weight_decay):
    """200 steps of lr 1e-6 on bf16 weights of scale 0.02: each step (~1e-7) is far below half the bf16 spacing
    there (6e-5). The displacement that AdamWBF16 holds (weights + Kahan compensation c) is within 5% (relative L2)
    of fp32-master AdamW's, and 99% of its bf16 weights are the nearest bf16 of the fp32 weights (the best a bf16
    weight can be). Written back without compensation, the steps are lost: relative error ~1. Weight decay 5 takes
    lr x 5 x 0.02 = 1e-7 a step, as much as Adam's step, so a decay lost shows (at 1e-2 it was 0.0003% of the
    displacement, far inside the 5%)."""
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
    opt = modeling.AdamWBF16([p32, p16], lr=1e-3)
    for p in (p32, p16):
        p.grad = torch.ones_like(p)
    before = p32.detach().clone()
    opt.step()
    assert {opt.state[p][k].dtype for p in (p32, p16) for k in ("exp_avg", "exp_avg_sq", "compensation")} \
        == {torch.bfloat16}
    assert torch.all(opt.state[p32]["compensation"] == 0)
    # First step of Adam with g = 1: m / (1 - b1) = 1, v / (1 - b2) = 1, so p moves by lr / (1 + eps).
    torch.testing.assert_close(p32.detach(), before - 1e-3 / (1 + 1e-8), rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_bf16_resumed_from_its_state_dict_steps_as_uninterrupted(dtype):
    """3 steps, state_dict -> a fresh optimizer's load_state_dict, 3 more steps: the same weights and state as 6
    steps in one go, bit for bit, on fp32 weights (master weights, LoRA adapters) and bf16 ones. torch's load casts
    the state to the parameter's dtype; on fp32 weights step() then overwrote m and v in place."""
    gen = torch.Generator().manual_seed(0)
    w0, grads = torch.randn(8, 4, generator=gen).to(dtype), [torch.randn(8, 4, generator=gen) for _ in range(6)]
    straight, resumed = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt = modeling.AdamWBF16([straight], lr=1e-2, weight_decay=0.1)
    first = modeling.AdamWBF16([resumed], lr=1e-2, weight_decay=0.1)
    for i, g in enumerate(grads):
        if i == 3:
            second = modeling.AdamWBF16([resumed], lr=1e-2, weight_decay=0.1)
            second.load_state_dict(first.state_dict())
        for p, o in ((straight, opt), (resumed, first if i < 3 else second)):
            p.grad = g.to(dtype)
            o.step()
    assert torch.equal(straight, resumed)
    for key in ("exp_avg", "exp_avg_sq", "compensation"):
        assert second.state[resumed][key].dtype == torch.bfloat16
        assert torch.equal(opt.state[straight][key], second.state[resumed][key]), key


# ----------------------------------------------------------------------------------------------
# AdamWBF16 on FSDP2 shards (2 gloo ranks) = on the full tensors in one process
# ----------------------------------------------------------------------------------------------

def _sharded_adamw_main(rank, store, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)  # no port to race for
    try:
        model = _tiny_model()
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        opt = modeling.AdamWBF16(model.parameters(), lr=1e-3, weight_decay=0.1)
        _train(model, opt)
        state = opt.state[model.weight]
        assert all(isinstance(state[k], DTensor) for k in ("exp_avg", "exp_avg_sq", "compensation"))
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        comp = state["compensation"].full_tensor()
        if rank == 0:
            torch.save((full, comp), out_path)
    finally:
        dist.destroy_process_group()
    leave_rank()


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
    codes = run_ranks(_sharded_adamw_main, [(r, str(tmp_path / "store"), str(tmp_path / "out.pt")) for r in range(2)],
                      timeout=120)
    assert codes == [0, 0], f"rank exit codes {codes}"
    full, comp = torch.load(tmp_path / "out.pt")
    model = _tiny_model()
    opt = modeling.AdamWBF16(model.parameters(), lr=1e-3, weight_decay=0.1)
    _train(model, opt)
    for name, p in model.named_parameters():
        assert torch.equal(full[name], p.detach()), name
    assert torch.equal(comp, opt.state[model.weight]["compensation"])


# ----------------------------------------------------------------------------------------------
# Offload (worker.actor.offload.*, worker.ref.offload.*)
# ----------------------------------------------------------------------------------------------

def text_samples(n=4, prompt=12, response=6):
    """Random token ids for the toy text model (167 tokens): a prompt, a response and an advantage each."""
    gen = torch.Generator().manual_seed(0)
    return [{"prompt_ids": torch.randint(3, 160, (prompt,), generator=gen).tolist(),
             "response_ids": torch.randint(3, 160, (response,), generator=gen).tolist(),
             "advantage": 1.0 if i % 2 else -1.0} for i in range(n)]


def test_host_copy_frees_storages_and_restores_them_with_their_views():
    """HostCopy (the offload mechanism) on CPU tensors standing in for device ones: after offload every storage is
    0 bytes and the host buffer holds the bytes; after onload a parameter, a view of its padded storage (FSDP2's
    sharded parameter) and a second tensor read their values again, an in-place change made between two round
    trips survives the next one, the buffer is reused, and a second offload or onload in a row changes nothing."""
    padded = torch.arange(10, dtype=torch.float32)  # FSDP2: the sharded parameter views its padded storage
    shard, state = padded[:7], torch.full((3, 2), 2.5, dtype=torch.bfloat16)
    host = modeling.HostCopy()
    host.offload([shard, padded, state])
    assert padded.untyped_storage().nbytes() == 0 and state.untyped_storage().nbytes() == 0
    assert host.buffer.numel() == 10 * 4 + 6 * 2
    buffer = host.buffer
    host.offload([shard, padded, state])  # already offloaded: nothing is overwritten
    host.onload()
    host.onload()
    assert torch.equal(shard, torch.arange(7, dtype=torch.float32)) and torch.equal(padded, torch.arange(10.0))
    assert torch.equal(state, torch.full((3, 2), 2.5, dtype=torch.bfloat16))
    shard.add_(1.0)  # an update between passes
    host.offload([shard, state])
    host.onload()
    assert torch.equal(padded[:7], torch.arange(1.0, 8.0)) and padded[9] == 9.0
    assert host.buffer is buffer


# EasyR1's examples/config.yaml, its memory settings: manual offload of the actor, FSDP's own offload for the ref.
EASYR1_MEMORY = ["worker.actor.offload.offload_params=true", "worker.actor.offload.offload_optimizer=true",
                 "worker.actor.fsdp.enable_cpu_offload=false", "worker.ref.fsdp.enable_cpu_offload=true",
                 "worker.ref.offload.offload_params=false", "worker.actor.model.enable_gradient_checkpointing=true"]


def test_easyr1_offload_settings_start_and_train_on_the_cpu(toy, monkeypatch, caplog):
    """EasyR1's example memory settings no longer raise: the worker starts, says once that offload does nothing
    on the CPU, and runs the old / ref log-prob passes and an update."""
    import workers
    from config import load_config

    cfg = load_config(None, EASYR1_MEMORY + [
        f"worker.actor.model.model_path={toy['text_model']}", "worker.rollout.name=hf", "trainer.device=cpu",
        "trainer.n_gpus_per_node=1", "worker.actor.global_batch_size=2", "worker.rollout.n=2",
        "data.max_prompt_length=16", "data.max_response_length=8"])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # setup sets them; restored after
        monkeypatch.setenv(key, "0")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    worker = workers.Worker()
    with caplog.at_level(logging.WARNING, logger="actor"):
        worker.setup(cfg, 0, 1, ("127.0.0.1", 0), "cpu", 1)
    lines = [r.getMessage() for r in caplog.records if "offload" in r.getMessage()]
    assert lines == ["actor: offload.offload_params / offload_optimizer do nothing: the parameters already live on "
                     "the CPU (device cpu)"], lines
    assert not worker.actor.offload_params and not worker.actor.offload_optimizer
    samples = text_samples()
    for s, old, ref in zip(samples, worker.log_probs(samples, "old"), worker.log_probs(samples, "ref")):
        s["old_logprobs"], s["ref_logprobs"] = old, ref
    metrics = worker.update(samples)
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0
    torch.distributed.destroy_process_group()  # setup's one-rank group (a reference, mixed precision): not for the next


def _where(actor):
    """({where the parameters' local shards are}, {where the optimizer's state tensors are}, their bytes): "host"
    for a tensor whose storage is freed (offloaded into modeling.HostCopy), else its device, "cuda" or "cpu"."""
    params = [modeling._local(p) for p in actor.module.parameters()]
    state = [modeling._local(v) for s in actor.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    place = lambda t: "host" if t.untyped_storage().nbytes() == 0 else t.device.type  # noqa: E731
    return ({place(t) for t in params}, {place(t) for t in state},
            sum(t.numel() * t.element_size() for t in params + state))


def _offload_cpu_main(rank, world, store, model_path, lora, out_path):
    """One of two gloo ranks of an FSDP2 actor on the CPU with the offload mechanism forced on (on a CPU it is
    off: there is no device memory to free): the same HostCopy of DTensor shards and reshard as on GPUs."""
    import torch.distributed as dist
    from test_actor_update import make_cfg

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        samples = text_samples(n=4 * world)[rank::world]
        results = {}
        for offload in (True, False):
            cfg = make_cfg(model_path, **{"global_batch_size": 2 * world, "micro_batch_size_per_device_for_update": 2,
                                          "model.lora.rank": 8 if lora else 0})
            torch.manual_seed(0)
            actor = actor_module.Actor(cfg, role="actor", device="cpu", max_prompt_length=16, max_response_length=8,
                                       n_per_prompt=2)
            actor.offload_params = actor.offload_optimizer = offload
            actor.offload()
            phases = []
            for _ in range(2):
                for s, lp in zip(samples, actor.compute_log_probs(samples)):
                    s["old_logprobs"] = lp
                actor.update(samples)
                phases.append(_where(actor)[:2])
            actor.onload(optimizer=True)
            phases.append(_where(actor)[:2])
            actor.offload()
            phases.append(_where(actor)[:2])
            results[offload] = (phases, {n: t.clone() for n, t in actor.named_tensors()}, _where(actor)[:2])
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()
    leave_rank()


@pytest.mark.parametrize("lora", [False, True])
def test_offload_of_fsdp2_shards_on_two_ranks_trains_as_without(toy, tmp_path, lora):
    """Two gloo ranks, FSDP2, the offload mechanism forced on: after every update the parameter shards and the
    optimizer state have no storage (they are in the host copy), onload(optimizer=True) brings both back, offload()
    frees them again, named_tensors() leaves them offloaded, and the weights after two steps equal those of the
    same steps without offload exactly (the copies move bytes, nothing else)."""
    codes = run_ranks(_offload_cpu_main, [(r, 2, str(tmp_path / "store"), toy["text_model"], lora,
                                           str(tmp_path / "out.pt")) for r in range(2)], timeout=240)
    assert codes == [0, 0], f"rank exit codes {codes}"
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    phases, weights, after_stream = results[True]
    host, cpu = ({"host"}, {"host"}), ({"cpu"}, {"cpu"})
    assert phases == [host, host, cpu, host], phases
    assert after_stream == host
    assert results[False][0] == [cpu] * 4  # without offload nothing is ever freed
    assert weights.keys() == results[False][1].keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, results[False][1][name]), name


def _offload_main(rank, world, port, model_path, lora, out_path):
    """One rank of an FSDP2 actor on CUDA with offload_params and offload_optimizer: where the tensors are and what
    the device holds after each pass; the weights it ends with, against the same updates without offload."""
    import torch.distributed as dist
    from test_actor_update import make_cfg

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        samples = text_samples(n=4 * world)[rank::world]
        results = {}
        for offload in (True, False):
            cfg = make_cfg(model_path, **{"offload.offload_params": offload, "offload.offload_optimizer": offload,
                                          "global_batch_size": 2 * world, "micro_batch_size_per_device_for_update": 2,
                                          "fsdp.mp_param_dtype": "fp32", "model.lora.rank": 8 if lora else 0})
            torch.manual_seed(0)
            actor = actor_module.Actor(cfg, role="actor", device="cuda", max_prompt_length=16, max_response_length=8,
                                       n_per_prompt=2)
            memory = [("init", _where(actor), torch.cuda.memory_allocated())]
            for s, lp in zip(samples, actor.compute_log_probs(samples)):
                s["old_logprobs"] = lp
            memory.append(("log_probs", _where(actor), torch.cuda.memory_allocated()))
            for _ in range(2):
                actor.update(samples)
            memory.append(("update", _where(actor), torch.cuda.memory_allocated()))
            actor.onload(optimizer=True)
            memory.append(("onload", _where(actor), torch.cuda.memory_allocated()))
            actor.offload()
            memory.append(("offload", _where(actor), torch.cuda.memory_allocated()))
            results[offload] = (memory, {n: t.float().cpu() for n, t in actor.named_tensors()})
            del actor
            torch.cuda.empty_cache()
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()
    leave_rank()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("world, lora", [(1, False), (1, True), (2, False)])
def test_offload_moves_parameters_and_optimizer_state_off_the_gpu(toy, tmp_path, world, lora):
    """FSDP2 on `world` GPUs: with offload, parameters and optimizer state are in host memory after construction
    and after every pass (their device storage freed), on the GPU after onload(optimizer=True); the device then
    holds them (allocated bytes rise by at least their size) and gives them back on offload(), holding at least that
    much less than the same passes without offload. The weights after two updates match a run without."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    codes = run_ranks(_offload_main, [(r, world, port, toy["text_model"], lora, str(tmp_path / "out.pt"))
                                      for r in range(world)], timeout=300)
    assert codes == [0] * world, f"rank exit codes {codes}"
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    memory = dict((phase, (where, allocated)) for phase, where, allocated in results[True][0])
    for phase in ("init", "log_probs", "update", "offload"):
        params, state, _ = memory[phase][0]
        lazy = phase in ("init", "log_probs")  # AdamW makes its state at the first step: none before the update
        assert params == {"host"} and (state <= {"host"} if lazy else state == {"host"}), (phase, params, state)
    params, state, size = memory["onload"][0]
    assert params == {"cuda"} and state == {"cuda"}, ("onload", params, state)
    assert memory["onload"][1] - memory["offload"][1] >= size, (size, memory)
    # The device keeps more than the model between passes (cuBLAS workspaces, 32 MiB a handle on Hopper): the same
    # passes without offload hold at least the parameters (and optimizer state) more than with it.
    allocated = {phase: a for phase, _, a in results[False][0]}
    for phase in ("log_probs", "update", "offload"):
        assert allocated[phase] - memory[phase][1] >= memory[phase][0][2], (phase, memory, allocated)
    without = {phase: where for phase, where, _ in results[False][0]}
    assert without["update"][0] == {"cuda"} and without["update"][1] == {"cuda"}, without["update"]
    for name, tensor in results[True][1].items():
        torch.testing.assert_close(tensor, results[False][1][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_unsharded_reference_with_cpu_offload_waits_in_host_memory(toy):
    """One worker whose reference computes in its stored dtype (no process group: the module is not sharded):
    fsdp.enable_cpu_offload, the reference's default, keeps its parameters in host memory between passes, as
    offload.offload_params does (it stayed on the GPU), and the log-probs equal those of a reference kept there."""
    from test_actor_update import make_cfg

    samples, out = text_samples(), {}
    for offload in (True, False):
        ref = actor_module.Actor(make_cfg(toy["text_model"], **{"fsdp.enable_cpu_offload": offload}), role="ref",
                                 device="cuda", max_prompt_length=16, max_response_length=8, n_per_prompt=2)
        places = {"host" if p.untyped_storage().nbytes() == 0 else p.device.type for p in ref.module.parameters()}
        assert not ref.sharded and places == ({"host"} if offload else {"cuda"}), places
        out[offload] = ref.compute_log_probs(samples)
        del ref
    for with_offload, without in zip(out[True], out[False]):
        assert torch.equal(with_offload, without)
