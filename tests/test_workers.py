"""workers.WorkerGroup without Ray: prompts split over ranks, samples sharded per mini-batch (balanced by tokens,
a prompt's responses kept together), results joined back in order, update metrics averaged over ranks; and what
a Worker's setup hands its Actor."""

import functools
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import workers
from config import ConfigError, load_config


def fake_group(world, mini_batch, vllm=False, **methods):
    """A WorkerGroup of `world` ranks whose worker methods run at once: methods[name](rank, *args) -> result."""
    group = workers.WorkerGroup.__new__(workers.WorkerGroup)
    group.world, group.mini_batch, group._get, group.vllm = world, mini_batch, lambda refs, what: refs, vllm
    group.workers = [types.SimpleNamespace(**{name: types.SimpleNamespace(remote=functools.partial(fn, rank))
                                             for name, fn in methods.items()}) for rank in range(world)]
    return group


def test_generate_deals_prompts_round_robin_and_joins_them_back_in_order():
    """Prompts a..e over 2 ranks: rank 0 gets a, c, e and rank 1 b, d; each returns 2 responses per prompt with its
    local prompt index. Joined: prompt indices 0..4 (local i of rank r -> 2 i + r), each prompt's 2 in order."""
    got = {}

    def generate(rank, prompts, sampling):
        got[rank] = [p["name"] for p in prompts]
        return [{"prompt_index": i, "text": p["name"] + str(j)} for i, p in enumerate(prompts) for j in range(2)]

    out = fake_group(2, 4, generate=generate).generate([{"name": c} for c in "abcde"], {"seed": 0})
    assert got == {0: ["a", "c", "e"], 1: ["b", "d"]}
    assert [(r["prompt_index"], r["text"]) for r in out] == [(i, c + str(j)) for i, c in enumerate("abcde")
                                                             for j in range(2)]


@pytest.mark.parametrize("vllm", [True, False])
def test_only_the_transformers_engine_is_sent_the_processors_pixel_values(vllm):
    """vLLM reads the images (and ids and videos); the pixel values, 6.1 MB of fp32 a 512 x 512 image, stay."""
    prompt = {"raw_prompt_ids": [1], "images": ["an image"], "multi_modal_inputs": {"pixel_values": torch.ones(2)}}
    sent = []
    fake_group(1, 1, vllm=vllm, generate=lambda rank, prompts, sampling: sent.extend(prompts) or []).generate(
        [prompt], {"seed": 0})
    assert ("multi_modal_inputs" in sent[0]) != vllm and sent[0]["images"] == ["an image"]
    assert "multi_modal_inputs" in prompt  # the driver's prompt keeps them for the actor's samples


SAMPLES = [{"id": i, "uid": u, "prompt_ids": [0] * p, "response_ids": [0] * r}  # mini-batches of 4: groups a, b | c, d
           for i, (u, p, r) in enumerate(zip("aabbccdd", (10, 10, 2, 2, 1, 1, 3, 3), (1, 1, 5, 5, 1, 1, 2, 2)))]


def test_shard_balances_each_mini_batch_by_prompt_and_response_tokens():
    """Tokens (prompt + response): a 22, b 14 | c 4, d 10. Each mini-batch's two groups go one to each rank, the
    heavier to rank 0: rank 0 = a then d, rank 1 = b then c, each rank's share of mini-batch 1 first. Balanced over
    the whole batch it was a + c vs b + d; by response tokens alone (a 2, b 10) b went to rank 0."""
    group = fake_group(2, 4)
    lists, indices = group.shard(SAMPLES)
    assert indices == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [[s["id"] for s in part] for part in lists] == indices
    uneven = [{"uid": u, "prompt_ids": [0], "response_ids": [0]} for u in "aaab"]  # groups of 3 and 1: by sample
    assert [len(i) for i in group.shard(uneven)[1]] == [2, 2]
    # Every rank gets as many samples (as many micro-batches): 10, 1, 1, 1 tokens -> 10 + 1 | 1 + 1, not 10 | 1 + 1 + 1.
    lopsided = [{"uid": u, "prompt_ids": [0] * (k - 1), "response_ids": [0]} for u, k in zip("abcd", (10, 1, 1, 1))]
    assert group.shard(lopsided)[1] == [[0, 3], [1, 2]]



def test_equal_groups_that_do_not_divide_over_the_ranks_are_placed_sample_by_sample():
    """A mini-batch of 3 prompts x 2 responses on 2 ranks: 3 groups cannot go 1.5 to a rank, so samples go one by one,
    3 to each rank. Tokens a 5, 5, b 3, 3, c 1, 1; largest first into the lighter rank (ties: rank 0): 0 -> r0, 1 ->
    r1, 2 -> r0 (5 = 5), 3 -> r1, 4 -> r0, 5 -> r1: 9 tokens each."""
    samples = [{"uid": u, "prompt_ids": [0] * (k - 1), "response_ids": [0]}
               for u, k in zip("aabbcc", (5, 5, 3, 3, 1, 1))]
    assert fake_group(2, 6).shard(samples)[1] == [[0, 2, 4], [1, 3, 5]]

def test_log_probs_come_back_in_sample_order_and_update_metrics_are_the_ranks_mean():
    """Rank 0 holds samples 0, 1, 6, 7 (as above): the joined log-probs follow the samples, not the ranks. Each
    rank's update metrics: rank 0 pg_loss 1, rank 1 pg_loss 3 -> the mean 2; lr 2 on both -> 2; n (its samples)
    4 on both -> 4."""
    group = fake_group(2, 4, log_probs=lambda rank, samples, kind: [f"{kind}{s['id']}" for s in samples],
                       update=lambda rank, samples: {"actor/pg_loss": 1.0 + 2 * rank, "actor/lr": 2.0,
                                                     "n": float(len(samples))})
    assert group.log_probs(SAMPLES, kind="old") == [f"old{i}" for i in range(8)]
    assert group.update(SAMPLES) == {"actor/pg_loss": 2.0, "actor/lr": 2.0, "n": 4.0}


def test_more_workers_than_gpus_is_a_config_error_not_a_wait(monkeypatch):
    """Two GPU workers on a Ray that sees one GPU: an error naming the keys at once; the placement group would wait
    600 s, then time out with Ray's words."""
    monkeypatch.setattr(workers.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(workers.ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 3.0})
    cfg = load_config(None, ["trainer.device=cuda", "trainer.nnodes=2", "trainer.n_gpus_per_node=2",
                             "worker.actor.global_batch_size=4", "data.rollout_batch_size=8", "worker.rollout.name=hf"])
    with pytest.raises(ConfigError, match=r"trainer.nnodes x trainer.n_gpus_per_node = 4 workers need a GPU each; "
                                          r"Ray sees 3 .*trainer.device=cpu, or auto, runs on the CPU"):
        workers.WorkerGroup(cfg, training_steps=1)
    # With the GPUs there, the group counts 4 workers and a mini-batch of global_batch_size 4 x n 5 = 20 responses.
    monkeypatch.setattr(workers.ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 4.0})
    monkeypatch.setattr(workers.ray.util, "placement_group", lambda *a, **kw: 1 / 0)  # stops before Ray is used
    group = workers.WorkerGroup.__new__(workers.WorkerGroup)
    with pytest.raises(ZeroDivisionError):
        group.__init__(cfg, training_steps=1)
    assert (group.world, group.mini_batch) == (4, 20)


def test_the_projects_info_messages_are_shown_and_other_libraries_stay_quiet():
    """The attention backend, the rows a filter dropped and other info messages were never shown: nothing set up
    logging, so Python printed warnings only. The README promises the backend's line."""
    code = ("import logging, workers, modeling; workers.show_logs(); modeling._log_backend('sdpa'); "
            "logging.getLogger('some_library').info('chatter'); logging.getLogger('data').warning('a warning')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=workers.HERE, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-2:] == ["actor: attention backend sdpa", "a warning"], done.stderr


def test_each_rank_samples_from_its_own_stream():
    """The round's seed s becomes derive_seed(s, rank) on each rank: ranks never replay each other's draws."""
    seen = []
    w = workers.Worker.__new__(workers.Worker)
    w.memory, w.rollout = {}, types.SimpleNamespace(generate=lambda prompts, **kw: seen.append(kw["seed"]) or [])
    for rank in (0, 1):
        w.rank = rank
        w.generate([], {"seed": 123, "n": 1})
    assert seen == [workers.rollout.derive_seed(123, 0), workers.rollout.derive_seed(123, 1)] and seen[0] != seen[1]


def setup_kwargs(monkeypatch, *overrides):
    """Worker.setup with the Actor and the rollout engine replaced: -> {role: the Actor's keyword arguments}."""
    seen = {}
    monkeypatch.setattr(workers.actor, "Actor", lambda cfg, role, **kw: seen.setdefault(role, kw))
    monkeypatch.setattr(workers.rollout, "make_rollout", lambda cfg, path, **kw: None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "0")
    monkeypatch.setattr(workers.torch, "set_num_threads", lambda n: None)
    cfg = load_config(None, ["worker.actor.fsdp.mp_param_dtype=fp32", *overrides])  # no mixed precision: no dist
    workers.Worker().setup(cfg, 0, 1, ("127.0.0.1", 0), "cpu", 10)
    return seen


def test_the_actor_gets_the_rollout_temperature_and_the_kl_loss_settings(monkeypatch):
    """Log-probs divide the logits by the sampling temperature (0.7); the KL loss weighs by kl_coef 0.05. With
    algorithm.disable_kl: no KL loss and no reference model."""
    kw = setup_kwargs(monkeypatch, "worker.rollout.temperature=0.7", "algorithm.kl_coef=0.05")
    assert (kw["actor"]["temperature"], kw["actor"]["kl_coef"], kw["actor"]["use_kl_loss"]) == (0.7, 0.05, True)
    assert "ref" in kw
    kw = setup_kwargs(monkeypatch, "algorithm.disable_kl=true")
    assert kw["actor"]["use_kl_loss"] is False and "ref" not in kw


def test_lora_builds_no_reference_and_its_ref_pass_turns_the_adapter_off(monkeypatch):
    """With LoRA the reference is the base model under the policy's adapter: no second model is built, and the ref
    log-probs are the policy's own with disable_adapter=True."""
    assert "ref" not in setup_kwargs(monkeypatch, "worker.actor.model.lora.rank=8")
    worker, calls = workers.Worker(), []
    worker.memory, worker.ref = {}, None
    worker.actor = types.SimpleNamespace(compute_log_probs=lambda samples, **kw: calls.append(kw) or ["logp"])
    assert worker.log_probs(["s"], "ref") == ["logp"] and calls == [{"disable_adapter": True}]


def test_one_worker_with_a_reference_and_mixed_precision_still_runs_fsdp2(monkeypatch):
    """One worker with a reference and bf16 compute over fp32 weights joins a one-rank process group, so the policy is
    sharded and cast as the reference is (KL 0 at step 1); fp32 compute, or no reference, needs none."""
    started = []
    monkeypatch.setattr(workers.dist, "init_process_group", lambda backend, **kw: started.append(backend))
    monkeypatch.setattr(workers.dist, "is_initialized", lambda: False)
    setup_kwargs(monkeypatch, "worker.actor.fsdp.mp_param_dtype=bf16")
    setup_kwargs(monkeypatch, "worker.actor.fsdp.mp_param_dtype=bf16", "algorithm.disable_kl=true")
    setup_kwargs(monkeypatch)
    assert started == ["gloo"]


def test_a_steps_memory_peaks_start_at_its_weight_sync(monkeypatch):
    """The last step's peaks (update: 9 GiB) are dropped at the sync, whose own peak is kept: 3 GiB in use after its
    KV-cache wake-up (1 GiB before). The device is a stand-in, so the sync's peak is recorded on a CPU too."""
    used = [2**30]
    monkeypatch.setattr(workers.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(workers.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(workers.torch.cuda, "mem_get_info", lambda device: (100 * 2**30 - used[0], 100 * 2**30))
    worker = workers.Worker()
    worker.memory = {"update": 9.0}  # the last step's peak
    worker.actor = types.SimpleNamespace(named_tensors=lambda: iter(()))
    worker.rollout = types.SimpleNamespace(load_weights=lambda tensors: list(tensors),
                                           wake_up=lambda: used.__setitem__(0, 3 * 2**30))
    worker.sync_weights()
    assert worker.memory == {"sync": 3.0}


def test_a_phases_peak_counts_what_it_allocated_last(monkeypatch):
    """A block whose last act allocates (the sync's KV-cache wake-up) is read after it ends: 10 GiB, not the 1 GiB
    in use before (on one H200 the sync's peak read 43 GB, its wake-up missed, and 85 GB with the last reading)."""
    used, reads = [2**30], []
    monkeypatch.setattr(workers.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(workers.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(workers.torch.cuda, "mem_get_info", lambda device: reads.append(used[0]) or (
        100 * 2**30 - used[0], 100 * 2**30))
    memory = {}
    with workers.device_peak(memory, "sync"):
        while not reads:  # the poller has read the memory in use before the block's last act
            pass
        used[0] = 10 * 2**30  # and exits at once, long before the poller's next 5 ms reading
    assert memory == {"sync": 10.0}



def test_a_phase_entered_twice_keeps_its_larger_peak(monkeypatch):
    """A step may generate in several rounds (online filtering, ReMax's greedy pass): its gen peak is the largest
    of them, 8 GiB, not the last round's 3 GiB."""
    used = [0]
    monkeypatch.setattr(workers.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(workers.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(workers.torch.cuda, "mem_get_info", lambda device: (100 * 2**30 - used[0], 100 * 2**30))
    memory = {}
    for gib in (8, 3):
        used[0] = gib * 2**30
        with workers.device_peak(memory, "gen"):
            pass
    assert memory == {"gen": 8.0}


def test_an_update_reports_each_phases_peak_and_what_the_rollouts_sleep_freed(monkeypatch):
    """A stand-in device of 100 GiB: the engine holds 30 GiB (the sync's and generation's peaks) until its sleep
    leaves 6 GiB in use, 24 GiB freed; the update then peaks at 10 GiB. The actor's metrics come back with a
    perf/peak_device_memory_gb/<phase> for each phase since the sync and perf/rollout_sleep_freed_gb 24. On a CPU
    the sleep measures nothing, and no memory key is added."""
    used = [30 * 2**30]
    monkeypatch.setattr(workers.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(workers.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(workers.torch.cuda, "mem_get_info", lambda device=None: (100 * 2**30 - used[0], 100 * 2**30))
    worker = workers.Worker()
    worker.memory, worker.freed = {"sync": 30.0, "gen": 30.0}, None
    worker.rollout = types.SimpleNamespace(sleep=lambda: used.__setitem__(0, 6 * 2**30))
    update = {"actor/pg_loss": 0.5}
    worker.actor = types.SimpleNamespace(update=lambda samples: used.__setitem__(0, 10 * 2**30) or dict(update))
    worker.sleep()
    assert worker.update(["a sample"]) == {
        "actor/pg_loss": 0.5, "perf/peak_device_memory_gb/sync": 30.0, "perf/peak_device_memory_gb/gen": 30.0,
        "perf/peak_device_memory_gb/update": 10.0, "perf/rollout_sleep_freed_gb": 24.0}
    monkeypatch.setattr(workers.torch.cuda, "is_available", lambda: False)
    worker.memory, worker.freed = {}, None
    worker.sleep()
    assert worker.update(["a sample"]) == {"actor/pg_loss": 0.5}


def test_a_failed_worker_call_is_one_error_whose_cause_is_the_workers_own_exception(monkeypatch):
    """Run._resume tells the actor's refusal of a checkpoint (a ValueError) from a crash by the cause."""
    group = workers.WorkerGroup.__new__(workers.WorkerGroup)
    refusal = ValueError("another LoRA rank")
    monkeypatch.setattr(workers.ray, "wait", lambda refs, num_returns: (refs[:1], refs[1:]))
    monkeypatch.setattr(workers.ray, "get", lambda refs: (_ for _ in ()).throw(
        workers.ray.exceptions.RayTaskError("Worker.load", "Traceback ...\nValueError: another LoRA rank", refusal)))
    with pytest.raises(RuntimeError, match="a worker failed during checkpoint load:") as caught:
        group._get(["ref"], "checkpoint load")
    assert caught.value.__cause__ is refusal


def test_results_come_back_in_call_order_each_read_once(monkeypatch):
    """_get waits for the workers in the order they finish and returns their results in the order called."""
    reads = []
    monkeypatch.setattr(workers.ray, "wait", lambda refs, num_returns: (refs[-1:], refs[:-1]))  # the last first
    monkeypatch.setattr(workers.ray, "get", lambda ref: reads.append(ref) or ref.upper())
    assert workers.WorkerGroup._get(None, ["a", "b", "c"], "generation") == ["A", "B", "C"]
    assert reads == ["c", "b", "a"]


def test_a_tensor_sent_to_a_worker_arrives_whole_writable_and_alone(monkeypatch):
    """Through Ray's own pickler with workers.send_tensors_as_bytes registered (no cluster needed): dtype, shape and
    values back as sent (bf16, bool, 0-d, empty, non-contiguous); a prompt's tensor shared by its samples travels
    once and comes back shared; a view travels as its own bytes, not its base's; the received tensor is the worker's
    own (Ray's buffer is read-only and may be another's), so an in-place change leaves the sent bytes as they were."""
    import ray.cloudpickle

    monkeypatch.setitem(ray.cloudpickle.CloudPickler.dispatch, torch.Tensor, None)  # restored after the test
    workers.send_tensors_as_bytes()
    image, base = torch.randn(6, 4).to(torch.bfloat16), torch.arange(1000.0)
    sent = [image, torch.arange(12).view(3, 4).t(), torch.tensor(True), torch.zeros(0, 3), base[10:20]]
    samples = [{"multi_modal_inputs": {"pixel_values": image}, "tensors": sent} for _ in range(5)]
    buffers = []
    blob = ray.cloudpickle.dumps(samples, protocol=5, buffer_callback=buffers.append)
    assert sum(b.raw().nbytes for b in buffers) == sum(t.numel() * t.element_size() for t in sent)  # each once
    kept = [t.clone() for t in sent]
    got = ray.cloudpickle.loads(blob, buffers=buffers)  # the sender's own memory: an alias would change `sent`
    assert all(s["multi_modal_inputs"]["pixel_values"] is got[0]["tensors"][0] for s in got)
    for tensor, back in zip(sent, got[0]["tensors"]):
        assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)
        back.logical_not_() if back.dtype == torch.bool else back.add_(1)
    assert all(torch.equal(t, k) for t, k in zip(sent, kept))


def test_a_local_ray_listens_on_the_loopback_only(tmp_path):
    """Every TCP socket that Ray's processes (GCS, raylet, workers, an actor) listen on is bound to 127.0.0.1."""
    script = (
        "import json, psutil, ray, workers\n"
        "workers._start_local_ray(num_cpus=1, include_dashboard=False)\n"
        "Echo = ray.remote(type('Echo', (), {'ip': lambda self: ray.util.get_node_ip_address()}))\n"
        "ip = ray.get(Echo.remote().ip.remote())\n"
        "me = psutil.Process()\n"
        "bound = [c.laddr.ip for p in [me] + me.children(recursive=True) for c in p.net_connections('tcp')\n"
        "         if c.status == psutil.CONN_LISTEN]\n"
        "print(json.dumps({'ip': ip, 'bound': bound}))\n"
        "ray.shutdown()\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=workers.HERE, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ip"] == "127.0.0.1"  # what the workers hand to torch.distributed as MASTER_ADDR
    assert len(out["bound"]) >= 3 and set(out["bound"]) <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, out["bound"]
