"""workers.py: the Ray plumbing under trainer.py, which a first reading can skip. One Ray actor per GPU (per process
on the CPU, gloo) hosts the policy (actor.Actor, FSDP2), the reference and the rollout engine, colocated."""

import copy
import dataclasses
import logging
import os
import socket
import threading

import torch
import torch.distributed as dist

import actor
import modeling
import rollout
from config import ConfigError

try:  # Ray is needed to train, not to read or check a config
    import ray
except ImportError:  # pragma: no cover
    ray = None

HERE = os.path.dirname(os.path.abspath(__file__))


class Worker:
    """Lives in its own process. Holds the policy (FSDP2), the reference and the rollout engine."""

    def setup(self, cfg, rank, world_size, master, device, training_steps):
        show_logs()
        send_tensors_as_bytes()  # the log-probs returned
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                           "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])})
        if device == "cpu":
            torch.set_num_threads(max(1, _usable_cpus() // world_size))
        self.memory, self.freed = {}, None  # phase -> peak GiB in use on the device; GiB the rollout's sleep freed
        a, d, r, alg = cfg.worker.actor, cfg.data, cfg.worker.rollout, cfg.algorithm
        needs_ref = not alg.disable_kl and a.model.lora.rank == 0  # LoRA: the policy, its adapter off
        # One worker with a reference and mixed precision runs FSDP2 too: it casts the weights as several workers
        # do, so the policy computes as the reference (KL 0 at step 1); autocast over fp32 weights is ~10% faster
        mixed = actor.DTYPES[a.fsdp.torch_dtype or "fp32"] != actor.DTYPES[a.fsdp.mp_param_dtype]
        if (world_size > 1 or (needs_ref and mixed)) and not dist.is_initialized():
            offload = device == "cuda" and a.fsdp.enable_cpu_offload  # CPU gradients: gloo reduces their norm
            backend = "cuda:nccl,cpu:gloo" if offload else "nccl" if device == "cuda" else "gloo"
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        shared = dict(device=device, max_prompt_length=d.max_prompt_length, max_response_length=d.max_response_length)
        common = dict(shared, temperature=r.temperature, training_steps=training_steps, kl_penalty=alg.kl_penalty,
                      n_per_prompt=r.n, kl_coef=alg.kl_coef, use_kl_loss=alg.use_kl_loss and not alg.disable_kl)
        torch.manual_seed(d.seed)  # the model's random init (LoRA adapters): the same on every rank and every run
        self.actor = actor.Actor(a, role="actor", **common)
        ref_cfg = dataclasses.replace(a, fsdp=cfg.worker.ref.fsdp, offload=cfg.worker.ref.offload)
        self.ref = actor.Actor(ref_cfg, role="ref", **common) if needs_ref else None
        r = copy.copy(r)
        r.trust_remote_code, r.override_config = a.model.trust_remote_code, a.model.override_config  # the model's
        self.rollout = rollout.make_rollout(r, a.model.model_path, tokenizer_path=a.model.tokenizer_path, **shared)
        self.rank = rank

    def sync_weights(self):  # a step's first call (and validation's): the peaks since the update are dropped
        self.memory.clear()
        with device_peak(self.memory, "sync"):
            self.rollout.load_weights(self.actor.named_tensors())  # vLLM wakes only its weights for this
            self.rollout.wake_up()  # then the KV cache

    def generate(self, prompts, sampling):  # also with no prompts: a TP peer may be waiting to gather
        seed = rollout.derive_seed(sampling["seed"], self.rank)  # the round's seed, one stream per rank
        with device_peak(self.memory, "gen"):
            return self.rollout.generate(prompts, **{**sampling, "seed": seed})

    def sleep(self):
        free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
        self.rollout.sleep()
        if free is not None:  # reported with the next update, as perf/rollout_sleep_freed_gb
            self.freed = (torch.cuda.mem_get_info()[0] - free) / 2**30

    def log_probs(self, samples, kind):
        with device_peak(self.memory, kind):
            if kind == "ref" and self.ref is None:  # LoRA: the reference is the base model, the adapter off
                return self.actor.compute_log_probs(samples, disable_adapter=True)
            return (self.ref if kind == "ref" else self.actor).compute_log_probs(samples)

    def update(self, samples):
        with device_peak(self.memory, "update"):
            metrics = self.actor.update(samples)
        metrics.update({f"perf/peak_device_memory_gb/{phase}": gib for phase, gib in self.memory.items()})
        if self.freed is not None:
            metrics["perf/rollout_sleep_freed_gb"] = self.freed
        return metrics

    def save(self, path, model_only):
        self.actor.onload(optimizer=True)  # all state saved and loaded on the device (EasyR1 onloads the parameters)
        self.actor.save_checkpoint(path, model_only=model_only)
        self.actor.offload()

    def load(self, path):
        self.actor.onload(optimizer=True)
        self.actor.load_checkpoint(path)
        self.actor.offload()

    def address(self):
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]


class WorkerGroup:
    """The driver's handle on the workers: splits lists of plain dicts over them, calls each, joins the results."""

    def __init__(self, cfg, training_steps):
        t = cfg.trainer
        self.device = "cuda" if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()) else "cpu"
        self.world = t.nnodes * t.n_gpus_per_node
        self.mini_batch = cfg.worker.actor.global_batch_size * cfg.worker.rollout.n  # divisible: check_config
        self.vllm = cfg.worker.rollout.name == "vllm"  # it reads the images, not the processor's pixel values
        if not ray.is_initialized():
            kwargs = dict(include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": _worker_env()})
            if "RAY_ADDRESS" in os.environ or os.path.exists("/tmp/ray/ray_current_cluster"):  # `ray start --head`
                ray.init(**kwargs)  # the user's cluster, joined as in EasyR1
            else:
                _start_local_ray(num_cpus=max(_usable_cpus(), self.world), **kwargs)
        send_tensors_as_bytes()
        gpu = 1 if self.device == "cuda" else 0
        if gpu and (have := ray.cluster_resources().get("GPU", 0)) < self.world:  # else a 600 s wait, then a timeout
            raise ConfigError(f"trainer.nnodes x trainer.n_gpus_per_node = {self.world} workers need a GPU each; Ray "
                              f"sees {have:g} (CUDA_VISIBLE_DEVICES, or the GPUs of the nodes joined to its cluster; "
                              "trainer.device=cpu, or auto, runs on the CPU without them)")
        self.pg = ray.util.placement_group([{"CPU": 1, "GPU": gpu}] * self.world, strategy="PACK")
        ray.get(self.pg.ready(), timeout=600)
        remote, place = ray.remote(Worker), ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        self.workers = [remote.options(num_cpus=1, num_gpus=gpu, scheduling_strategy=place(
                            self.pg, placement_group_bundle_index=i)).remote() for i in range(self.world)]
        master = self._get([self.workers[0].address.remote()], "start")[0]
        self._get([w.setup.remote(cfg, i, self.world, master, self.device, training_steps)
                   for i, w in enumerate(self.workers)], "setup")

    def _get(self, refs, what):
        """ray.get, but a dead or failing worker is one clear error, raised at once (others may hang in collectives)."""
        try:
            results, pending = {}, list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                results[done[0]] = ray.get(done[0])  # raises a failed worker's error
            return [results[ref] for ref in refs]
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"a worker died during {what}: {e}") from None
        except ray.exceptions.RayTaskError as e:  # the worker's own exception stays the cause (Run._resume reads it)
            raise RuntimeError(f"a worker failed during {what}:\n{e}") from e.cause

    def sync_weights(self):
        self._get([w.sync_weights.remote() for w in self.workers], "weight sync")

    def sleep(self):
        self._get([w.sleep.remote() for w in self.workers], "rollout sleep")

    def generate(self, prompts, sampling):
        """Split prompts over all ranks, each its own share. The ranks of a tensor-parallel group hand their
        shares to one vLLM engine (rollout.py gathers them), which generates each prompt n times, once."""
        if self.vllm:  # the pixel values stay on the driver (6.1 MB of fp32 for a 512 x 512 image)
            prompts = [{k: v for k, v in p.items() if k != "multi_modal_inputs"} for p in prompts]
        outs = self._get([w.generate.remote(prompts[i::self.world], sampling) for i, w in enumerate(self.workers)],
                         "generation")
        responses = [{**r, "prompt_index": r["prompt_index"] * self.world + rank}
                     for rank, out in enumerate(outs) for r in out]  # rank i holds prompts i, i + world, ...
        return sorted(responses, key=lambda r: r["prompt_index"])  # stable: a prompt's responses keep their order

    def shard(self, samples):
        """Per mini-batch, balance samples across ranks by tokens, as many on each; a prompt's responses stay on one
        rank when the groups divide evenly (its image is then encoded once). -> (per-rank lists, per-rank indices)."""
        indices = [[] for _ in range(self.world)]
        for start in range(0, len(samples), self.mini_batch):
            chunk = list(range(start, min(start + self.mini_batch, len(samples))))
            groups = {}
            for i in chunk:
                groups.setdefault(samples[i]["uid"], []).append(i)
            units = list(groups.values())
            if len(units) % self.world or len({len(u) for u in units}) > 1:
                units = [[i] for i in chunk]
            lengths = [sum(len(samples[i]["prompt_ids"]) + len(samples[i]["response_ids"]) for i in u) for u in units]
            for rank, part in enumerate(modeling.partition_balanced(lengths, self.world, equal_size=True)):
                indices[rank] += [i for j in part for i in units[j]]
        return [[samples[i] for i in idx] for idx in indices], indices

    def log_probs(self, samples, kind):
        lists, indices = self.shard(samples)
        outs = self._get([w.log_probs.remote(l, kind) for w, l in zip(self.workers, lists)], f"{kind} log-probs")
        by_index = {i: logp for idx, out in zip(indices, outs) for i, logp in zip(idx, out)}
        return [by_index[i] for i in range(len(samples))]  # in the order of `samples`

    def update(self, samples):
        """One policy update on every rank (Worker.update -> actor.Actor.update); the ranks' metrics averaged."""
        lists, _ = self.shard(samples)
        outs = self._get([w.update.remote(l) for w, l in zip(self.workers, lists)], "actor update")
        return {k: sum(o[k] for o in outs) / len(outs) for k in outs[0]}

    def save(self, path, model_only):
        self._get([w.save.remote(path, model_only) for w in self.workers], "checkpoint save")

    def load(self, path):
        self._get([w.load.remote(path) for w in self.workers], "checkpoint load")

    def shutdown(self):
        for w in self.workers:
            ray.kill(w)
        ray.util.remove_placement_group(self.pg)


class device_peak:
    """with device_peak(memory, "gen"): ... keeps in memory["gen"] the most GiB in use on this process's GPU while
    the block ran, polled every 5 ms (cudaMemGetInfo: all processes and allocators, vLLM's pool too). No-op on CPU."""

    def __init__(self, memory, name):
        self.memory, self.name, self.done, self.peak = memory, name, threading.Event(), 0

    def __enter__(self):
        if torch.cuda.is_available():
            self.thread = threading.Thread(target=self._poll, args=(torch.cuda.current_device(),), daemon=True)
            self.thread.start()

    def _poll(self, device):
        while True:  # until a reading begun after the block ended: its last allocation (a wake-up) counts
            ended = self.done.is_set()
            free, total = torch.cuda.mem_get_info(device)
            self.peak = max(self.peak, total - free)
            if ended:
                return
            self.done.wait(0.005)

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            self.done.set()
            self.thread.join()
            self.memory[self.name] = max(self.memory.get(self.name, 0.0), self.peak / 2**30)


def show_logs():
    """The project's info messages (the attention backend, the rows a filter dropped, ...) on stderr beside its
    warnings, in the driver and in each worker; other libraries' loggers keep their levels."""
    logging.basicConfig(format="%(message)s")
    for name in ("actor", "config", "data", "modeling"):
        logging.getLogger(name).setLevel(logging.INFO)


def send_tensors_as_bytes():
    """Ray then sends a tensor in a call or a result as its bytes in a numpy array, copied once into its shared memory
    (pickle 5, out of band), not through torch's own pickling: 4-8x faster (benchmarks/data_build.py), and a view
    sends its own bytes, where torch's pickling sent its base's (each piece of a split: the whole tensor)."""
    ray.util.register_serializer(torch.Tensor, serializer=_tensor_to_bytes, deserializer=_tensor_from_bytes)


def _tensor_to_bytes(tensor):
    tensor = tensor.detach().cpu().contiguous()
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor.reshape(-1).view(torch.uint8).numpy()


def _tensor_from_bytes(parts):  # a copy of Ray's read-only buffer: the worker's own tensor, as pickling gives
    dtype, shape, data = parts
    return torch.tensor(data).view(getattr(torch, dtype)).reshape(shape)  # torch.tensor copies


def _worker_env():
    passed = ("HF_HUB_OFFLINE", "HF_HOME", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")  # as the driver has them
    return {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
            "VLLM_LOGGING_LEVEL": "WARN", "NCCL_DEBUG": "WARN", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            "VLLM_ALLREDUCE_USE_SYMM_MEM": "0", **{key: os.environ[key] for key in passed if key in os.environ}}


def _start_local_ray(**kwargs):
    """ray.init of a one-machine Ray whose processes listen on 127.0.0.1 only: ray.init keeps a 127.0.0.1
    `_node_ip_address` only while ray_constants.ENABLE_RAY_CLUSTER is off, so it is turned off around the call."""
    from ray._private import ray_constants

    saved, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        ray.init(_node_ip_address="127.0.0.1", **kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _usable_cpus():
    """CPU cores this process may run on (taskset and cgroup CPU sets honoured, unlike os.cpu_count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
