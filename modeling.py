"""modeling.py: the model plumbing under actor.py, skippable on a first reading. Imports no stage.

Needs transformers >= 5.18 (Qwen-VL forwards take `mm_encoder_outputs`; tested with 5.22.2, 5.24.0), torch >= 2.6."""

import functools
import inspect
import logging
import math
import types
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.checkpoint import checkpoint
from transformers import (AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                          PreTrainedConfig, vision_utils)

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "flash" in the name makes transformers' Qwen-VL vision attention pass its per-window / per-image cu_seqlens in one
# call (`is_flash_attention_requested` is a substring test).
ATTENTION = "packed_flash_varlen"
HEAD_CHUNK = 1024  # response tokens per LM-head chunk: [1024, vocab] fp32 logits at a time
# Dense bf16 peak TFLOP/s by device-name substring, first match wins: "H200" must come before "H20".
PEAK_TFLOPS = [("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("H20", 148.0), ("B200", 2250.0),
               ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("4090", 165.0)]
VISION_CALLS = {"image": ("get_image_features", "pixel_values", "image_grid_thw"),
                "video": ("get_video_features", "pixel_values_videos", "video_grid_thw")}


# --- Building the model: loading, LoRA, FSDP2 ----------------------------------------------------------------------

def build_model(cfg, role, device, master_dtype, compute_dtype, lora_rank, compile_layers=False, longest=0):
    """-> (hf model, state module (the peft model with LoRA, else hf), config), ready for packed_forward; check_packable
    (for `longest` tokens) refuses before the weights load. A VL model when the config has a vision_config; attention
    is packed_attention; LoRA adapters in the master dtype on frozen base weights in the compute dtype. With
    fsdp.enable_rank0_init rank 0 reads the weights and the other ranks, built on the meta device, receive them."""
    sharded = dist.is_available() and dist.is_initialized()
    rank0_init = sharded and dist.get_world_size() > 1 and cfg.fsdp.enable_rank0_init
    model_cfg = cfg.model
    AttentionInterface.register(ATTENTION, packed_attention)
    config = AutoConfig.from_pretrained(model_cfg.model_path, trust_remote_code=model_cfg.trust_remote_code)
    apply_overrides(config, model_cfg.override_config)
    check_packable(config, longest, model_cfg.model_path)
    if getattr(config.get_text_config(), "output_router_logits", False) and role == "actor":
        logger.warning("%s: output_router_logits is set, but the packed pass adds no router auxiliary loss to the "
                       "policy loss (transformers' forward would)", model_cfg.model_path)
    is_vl = getattr(config, "vision_config", None) is not None
    auto = AutoModelForImageTextToText if is_vl else AutoModelForCausalLM
    weights_dtype = compute_dtype if lora_rank else master_dtype
    if rank0_init and dist.get_rank() != 0:
        with torch.device("meta"):
            hf = auto.from_config(config, dtype=weights_dtype, trust_remote_code=model_cfg.trust_remote_code)
    else:
        hf = auto.from_pretrained(model_cfg.model_path, config=config, dtype=weights_dtype,
                                  trust_remote_code=model_cfg.trust_remote_code, attn_implementation="eager")
    for m in hf.modules():  # every module's config; the setter recurses into sub-configs
        if isinstance(getattr(m, "config", None), PreTrainedConfig):
            m.config._attn_implementation = ATTENTION
    module = hf
    tied = (head := hf.get_output_embeddings()) is not None and head.weight is hf.get_input_embeddings().weight
    if head is not None and not tied and getattr(config, "tie_word_embeddings", False):  # transformers' own test
        raise ValueError(f"{model_cfg.model_path}: config.json ties the LM head to the input embeddings, but the "
                         "weights hold two tensors (vLLM would sample with the embeddings as the head): set "
                         "worker.actor.model.override_config='{tie_word_embeddings: false}'")
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        lora = model_cfg.lora
        targets = lora.target_modules if lora.target_modules == "all-linear" else \
            [t.strip() for t in lora.target_modules.split(",") if t.strip()]
        exclude = None if lora.exclude_modules == ".*visual.*" and not is_vl else lora.exclude_modules  # no tower
        try:
            module = get_peft_model(hf, LoraConfig(task_type="CAUSAL_LM", r=lora.rank, lora_alpha=lora.alpha,
                                                   target_modules=targets, exclude_modules=exclude))
        except ValueError as e:  # e.g. peft's "No modules were targeted": name the keys
            raise ValueError(f"worker.actor.model.lora.target_modules={lora.target_modules!r}, exclude_modules="
                             f"{lora.exclude_modules!r} (a regex): {str(e).splitlines()[0]}") from e
        if tied and any(hasattr(m, "base_layer") for m in (hf.get_output_embeddings(), hf.get_input_embeddings())):
            raise ValueError(f"worker.actor.model.lora.target_modules={lora.target_modules!r} puts LoRA on the LM head "
                             f"or the embeddings, which this model ties (tie_word_embeddings): the actor would adapt "
                             f"one, the rollout's copy of the shared weight both. Leave lm_head and embed_tokens out")
        adapters = {n: m for n, m in module.named_modules() if hasattr(m, "base_layer")}  # each LoRA-wrapped layer
        if odd := [n for n, m in adapters.items() if not isinstance(m.base_layer, torch.nn.Linear)]:
            raise ValueError(f"worker.actor.model.lora.target_modules={lora.target_modules!r} puts LoRA on {odd[0]}, "
                             f"not a Linear layer: the weight sync and merge.py merge Linear adapters only (a mixture "
                             f"of experts' experts: list the modules, e.g. q_proj,k_proj,v_proj,o_proj)")
        adapted = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in adapters}))
        logger.info("actor: LoRA rank %d on %s; every other weight frozen", lora.rank, adapted)
        if fused := [n for n, m in hf.named_modules() if n.endswith("experts") and [*m.parameters(recurse=False)]]:
            logger.warning("worker.actor.model.lora.target_modules=%r leaves the experts (%s, ...) frozen: fused "
                           "experts are not Linear layers, which peft adapts", lora.target_modules, fused[0])
        for p in module.parameters():
            p.data = p.data.to(master_dtype if p.requires_grad else compute_dtype)
    full_state = dict(module.state_dict()) if rank0_init and dist.get_rank() == 0 else None

    if role == "ref":
        module.requires_grad_(False)
    elif model_cfg.freeze_vision_tower and is_vl:
        vision_tower(hf).requires_grad_(False)
    elif model_cfg.freeze_vision_tower:
        logger.warning("worker.actor.model.freeze_vision_tower: %s has no vision tower; nothing is frozen",
                       model_cfg.model_path)
    if role == "actor" and model_cfg.enable_gradient_checkpointing:
        # newer transformers call it activation_checkpointing_enable (the old name warns); same arguments
        enable = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    hf.train(role == "actor")  # dropout is 0 in the supported models; train() enables checkpointing
    if compile_layers:  # each decoder layer / vision block fused by torch.compile (dynamic shapes); attention eager
        # ~10 graphs (layer class x FSDP subclass x input rank) of one checkpointing wrapper: torch's limit is 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for m in layer_units(hf):
            m.compile(dynamic=True)
    hf.packed_forward = types.MethodType(packed_forward, hf)
    if not sharded:
        return hf.to(device), module, config

    # FSDP2: fully_shard every decoder layer and vision block, then the root; 0 < fsdp_size < world: hybrid sharding
    # (replicate x shard). Only the root casts its floating inputs (pixels): a layer's cast would run in the forward
    # but not in the checkpoint recompute (FSDP2 skips its pre-forward there), so the fp32 vision rotary would differ.
    size, world = cfg.fsdp.fsdp_size, dist.get_world_size()
    shape, names = ((world // size, size), ("ddp", "fsdp")) if 0 < size < world else ((world,), ("fsdp",))
    offload = CPUOffloadPolicy() if cfg.fsdp.enable_cpu_offload and device.type == "cuda" else OffloadPolicy()
    kwargs = dict(mesh=init_device_mesh(device.type, shape, mesh_dim_names=names), offload_policy=offload,
                  reshard_after_forward=cfg.fsdp.enable_full_shard)
    precision = [MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=DTYPES[cfg.fsdp.mp_reduce_dtype],
                                      cast_forward_inputs=cast) for cast in (False, True)]
    for m in layer_units(hf):
        fully_shard(m, mp_policy=precision[0], **kwargs)
    fully_shard(hf, mp_policy=precision[1], **kwargs)
    if rank0_init:  # rank 0's weights to the meta-built ranks, then the buffers no state dict holds (rotary inv_freq)
        set_model_state_dict(module, full_state or {}, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        if tied:  # the load gave the meta-built ranks' head its own tensor: a stray parameter in their optimizer
            hf.get_output_embeddings().weight = hf.get_input_embeddings().weight
        comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
        for m in hf.modules():
            for name, buf in list(m.named_buffers(recurse=False, remove_duplicate=False)):
                local = torch.empty(buf.shape, dtype=buf.dtype, device=comm) if buf.is_meta else buf.to(comm)
                dist.broadcast(local, src=0)
                m._buffers[name] = local.to(device)
    register_fsdp_forward_method(hf, "packed_forward")  # the root's parameters are gathered around it
    return hf, module, config


def check_packable(config, longest, where):
    """Refuse, from the config alone (build_model; the trainer before any worker starts), a model whose token mixing
    the packed pass gets wrong: capped attention scores (Gemma2), a sliding window shorter than `longest` tokens,
    other attention patterns (chunked, sparse), recurrent or hybrid layers (conv, Mamba, linear attention: they run
    across the packed row's sequence boundaries, which only attention is given)."""
    text = config.get_text_config()
    if cap := getattr(text, "attn_logit_softcapping", None):
        raise ValueError(f"{where}: attn_logit_softcapping={cap} (Gemma2's cap on attention scores) is not implemented "
                         "by the packed attention; override_config '{attn_logit_softcapping: null}' drops it from the "
                         "model (in the rollout too)")
    window, kinds = getattr(text, "sliding_window", None), getattr(text, "layer_types", None)
    slides = "sliding_attention" in kinds if kinds else getattr(text, "use_sliding_window", True)  # else every layer
    if window and slides and longest > window:  # (Mistral), unless switched off (Qwen3-VL's config keeps the window)
        drop = "{sliding_window: null" + (", layer_types: [full_attention, ...]}' (one per layer)" if kinds else "}'")
        raise ValueError(f"{where}: its sliding window ({window} tokens) is shorter than data.max_prompt_length + "
                         f"max_response_length ({longest}), and the packed attention applies no window: lower the "
                         f"lengths, or drop the window in the rollout too with worker.actor.model.override_config="
                         f"'{drop}")  # (use_sliding_window, read when the config is built, would change nothing)
    others = {t for t in kinds or [] if t not in ("full_attention", "sliding_attention")}
    if patterns := sorted(t for t in others if t.endswith("attention") and t != "linear_attention"):  # Llama4, DS-V4
        raise ValueError(f"{where}: its {', '.join(patterns)} layers attend in a pattern that the packed attention "
                         "does not implement (it computes full causal attention within each sequence): not supported")
    if mixers := sorted(others | {"mamba" for key in text.to_dict() if key.startswith("mamba_")}):  # Falcon-H1
        raise ValueError(f"{where}: its {', '.join(mixers)} layers carry a state along the sequence, but the packed "
                         "pass, several sequences to a row, gives their boundaries to attention only: each would see "
                         "the ones before it. Recurrent and hybrid models are not supported")


def apply_overrides(config, overrides, where="worker.actor.model.override_config"):
    """Set model.override_config on a loaded config in place; -> the values set, nested as the config is (vLLM's
    hf_overrides). A key goes to the config, else to its text config (a VL model's language keys, which AutoConfig's
    kwargs drop silently); a dict merges into a sub-config or a dict value. A key neither has raises ValueError."""
    text, changes = config.get_text_config(), {}
    text_key = next((k for k in getattr(config, "sub_configs", {}) if getattr(config, k, None) is text), None)
    for key, value in (overrides or {}).items():
        on_text = not hasattr(config, key) and text_key is not None and hasattr(text, key)
        target, out = (text, changes.setdefault(text_key, {})) if on_text else (config, changes)
        if not hasattr(target, key):
            raise ValueError(f"{where}.{key}: no such key in {type(config).__name__}"
                             f"{f' or its {text_key}' if text_key else ''} (the model's config.json)")
        current = getattr(target, key)
        if isinstance(current, PreTrainedConfig) and isinstance(value, dict):
            out.setdefault(key, {}).update(apply_overrides(current, value, f"{where}.{key}"))
        else:
            out[key] = {**current, **value} if isinstance(current, dict) and isinstance(value, dict) else value
            setattr(target, key, out[key])
    return changes


def layer_units(hf):
    """The decoder layers and vision blocks (the model's _no_split_modules): each compiled and sharded alone."""
    names = set(getattr(hf, "_no_split_modules", None) or [])
    return [m for m in hf.modules() if type(m).__name__ in names]


def vision_tower(hf):
    body = getattr(hf, hf.base_model_prefix)
    if "mm_encoder_outputs" not in inspect.signature(body.forward).parameters:
        raise RuntimeError(f"transformers {transformers.__version__}: {type(body).__name__}.forward takes no "
                           "mm_encoder_outputs (packed_forward runs the vision tower itself, the same on every rank); "
                           "install transformers>=5.18 (tested with 5.22.2 and 5.24.0)")
    tower = getattr(body, "visual", None)
    if tower is None:
        raise ValueError(f"{type(hf).__name__} has no vision tower at .{hf.base_model_prefix}.visual; modeling.py "
                         "knows the Qwen2-VL, Qwen2.5-VL and Qwen3-VL layouts")
    return tower


def dummy_vision_input(hf, device):
    """(pixel rows [16, dim] on `device`, grid_thw [[1, 4, 4]] as a list, spatial merge size): the smallest valid
    image for the tower, in the form packed_forward takes it without a host sync."""
    dim = vision_tower(hf).patch_embed.proj.weight[0].numel()  # channels x temporal patch x patch x patch
    return torch.zeros(16, dim, device=device), [[1, 4, 4]], hf.config.vision_config.spatial_merge_size


# --- Packing and balancing -----------------------------------------------------------------------------------------

def partition_balanced(lengths, k, equal_size=False):
    """Split indices 0..len(lengths)-1 into k groups with near-equal sums of lengths: largest first, each
    into the lightest group (that still has room, with equal_size: len(lengths) / k items per group).
    Returns k lists of indices, each ascending; groups may be empty when k > len(lengths)."""
    if k < 1:
        raise ValueError(f"partition_balanced: k must be >= 1, got {k}")
    if equal_size and len(lengths) % k:
        raise ValueError(f"partition_balanced: {len(lengths)} items cannot be split into {k} equal groups")
    capacity = len(lengths) // k if equal_size else len(lengths)
    groups, sums = [[] for _ in range(k)], [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min((g for g in range(k) if len(groups[g]) < capacity), key=lambda g: (sums[g], len(groups[g]), g))
        groups[g].append(i)
        sums[g] += lengths[i]
    return [sorted(g) for g in groups]


def shared_image_units(samples, lengths, budget):
    """Sample indices in units to place whole: the samples that share their images (the n responses of an image
    prompt) together, in runs of at most `budget` tokens; every other sample alone."""
    units, unit_of = [], {}
    for i, sample in enumerate(samples):
        inputs = sample.get("multi_modal_inputs") or {}
        key = tuple(pixels_key(inputs, k) for k in ("pixel_values", "pixel_values_videos") if k in inputs) or None
        u = unit_of.get(key) if key else None
        if u is None or sum(lengths[j] for j in units[u]) + lengths[i] > budget:
            units.append([])
            u = len(units) - 1
            if key:
                unit_of[key] = u
        units[u].append(i)
    return units


def pixels_key(inputs, key):
    """What makes two samples' images (videos) the same: their pixel tensor's memory and shape. The n responses of
    a prompt share the prompt's tensors, also in a worker (Ray pickles a tensor several dicts hold once: one copy)."""
    pixels = torch.as_tensor(inputs[key])
    return key, pixels.data_ptr(), tuple(pixels.shape)


def micro_batches_needed(lengths, budget):
    """The fewest groups >= ceil(total / budget) whose balanced partition keeps every group of two or more
    sequences within `budget` tokens (a longer single sequence gets a group of its own)."""
    k = max(1, math.ceil(sum(lengths) / budget))
    while k < len(lengths) and not all(sum(lengths[i] for i in g) <= budget or len(g) == 1
                                       for g in partition_balanced(lengths, k)):
        k += 1
    return max(1, min(k, len(lengths)))


def pack_samples(samples, is_vl, names=None, image_token_id=None, video_token_id=None, merge=None):
    """Samples -> one padding-free row. Returned tensors are on the CPU:

        input_ids        [1, T]           prompt + response of every sample, back to back
        position_ids     [4, 1, T] (VL) or [1, T] (text): each sample's prompt rows, continued over the
                                          response at last + 1, last + 2, ... in every row
        cu_seqlens       [n + 1] int32    sequence boundaries in the row;  max_seqlen: int
        resp_index       [N]              row positions whose output predicts a response token (the one before it)
        labels           [N]              the response tokens: shifted labels built per sequence, never across
        resp_cu_seqlens  [n + 1] int32    each sample's response tokens in [N]
        resp_lens, seq_lens  list[int];   mm: the multi-modal tensors, each image (video) once, in sample order
        mm_order         {"image" / "video": [k]}   the image (video) of `mm` behind each one of the row: samples
                                          that share pixel tensors (pixels_key) share their images, encoded once"""
    names = names or [f"sample {i}" for i in range(len(samples))]
    ids, positions, resp_index, labels, seq_lens, resp_lens, mm = [], [], [], [], [], [], {}
    order, first = {"image": [], "video": []}, {}  # first: pixels_key -> the index of its first image in `mm`
    for name, s in zip(names, samples):
        prompt, response = list(s["prompt_ids"]), list(s["response_ids"])
        if not prompt:
            raise ValueError(f"pack_samples: {name} has an empty prompt")
        pos = s.get("position_ids")
        pos = torch.arange(len(prompt))[None] if pos is None else torch.as_tensor(pos).long()  # [R, P]
        if pos.ndim != 2 or pos.shape[1] != len(prompt):
            raise ValueError(f"pack_samples: {name}: position_ids has shape {tuple(pos.shape)}, expected "
                             f"[rows, {len(prompt)}] (rows, prompt length)")
        inputs = s.get("multi_modal_inputs") or {}
        if ("pixel_values" in inputs or "pixel_values_videos" in inputs) and (not is_vl or pos.shape[0] == 1):
            raise ValueError(f"pack_samples: {name}: images / videos " + ("need the model's mrope position_ids [4, P] "
                             "(data.py; 0..P-1 would misplace them)" if is_vl else "given to a text model"))
        if is_vl and pos.shape[0] == 1:  # text-only row of a VL model: all four rows alike
            pos = pos.expand(4, -1)
        elif is_vl and pos.shape[0] == 3:  # mrope rows only: put the text row on top
            pos = torch.cat([torch.arange(pos.shape[1])[None], pos])
        if pos.shape[0] != (4 if is_vl else 1):
            raise ValueError(f"pack_samples: {name}: position_ids has {pos.shape[0]} rows; a VL model takes 4 "
                             "(text + t/h/w; 1 or 3 are completed), a text model 1")
        positions.append(torch.cat([pos, pos[:, -1:] + torch.arange(1, len(response) + 1)], dim=1))  # [R, L]
        for modality, token in (("image", image_token_id), ("video", video_token_id)):
            _, key, grid = VISION_CALLS[modality]
            expected = int((torch.as_tensor(inputs[grid]).prod(-1) // merge**2).sum()) if key in inputs else 0
            if is_vl and (prompt.count(token) != expected or token in response):
                raise ValueError(f"pack_samples: {name} has {prompt.count(token)} {key} placeholder tokens in its "
                                 f"prompt (and {response.count(token)} in its response) for {expected} "
                                 f"{key} features; expand the placeholders the way the processor does")
            if key not in inputs:
                continue
            count, same = len(torch.as_tensor(inputs[grid])), pixels_key(inputs, key)
            if same not in first:  # a new prompt's images: encoded once for all its samples here
                first[same] = sum(len(g) for g in mm.get(grid, []))
                for k in (key, grid):
                    mm.setdefault(k, []).append(torch.as_tensor(inputs[k]))
            order[modality] += range(first[same], first[same] + count)
        start = len(ids) + len(prompt) - 1  # the row position that predicts the first response token
        resp_index.append(torch.arange(start, start + len(response)))
        ids += prompt + response
        labels += response
        seq_lens.append(len(prompt) + len(response))
        resp_lens.append(len(response))
    position_ids = torch.cat(positions, dim=1)  # [R, T]
    return {
        "input_ids": torch.tensor([ids]), "position_ids": position_ids[:, None] if is_vl else position_ids,
        "cu_seqlens": torch.tensor([0] + seq_lens).cumsum(0, dtype=torch.int32), "max_seqlen": max(seq_lens),
        "resp_index": torch.cat(resp_index), "labels": torch.tensor(labels, dtype=torch.long),
        "resp_cu_seqlens": torch.tensor([0] + resp_lens).cumsum(0, dtype=torch.int32),
        "resp_lens": resp_lens, "seq_lens": seq_lens, "mm": {k: torch.cat(v) for k, v in mm.items()}, "mm_order": order,
    }


# --- The forward: body, vision calls, response-only head -----------------------------------------------------------

def packed_forward(hf, batch, temperature, with_entropy, modalities, dummy_vision):
    """Bound to the HF model as `packed_forward` (an FSDP2 forward method when sharded): a packed batch -> (logp [N],
    entropy [N] or [0]) of its response tokens. Vision: one call per modality in `modalities` per micro-batch, on a
    dummy joined as zero rows where the batch lacks that input. No host sync: grids come as host lists (vision_indices);
    every tensor must already be on the device (else FSDP2's root copies it there, blocking)."""
    body = getattr(hf, hf.base_model_prefix)
    kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                  packed_cu_seqlens=batch["cu_seqlens"], packed_max_seqlen=batch["max_seqlen"])
    encoded, device = {}, batch["input_ids"].device
    for modality in modalities:
        method, pixels, grid = VISION_CALLS[modality]
        real = pixels in batch["mm"]
        x, thw = (batch["mm"][pixels], batch["mm"][grid]) if real else dummy_vision[:2]
        thw = torch.as_tensor(thw)  # [n, 3] on the host
        out = getattr(body, method)(x, thw, return_dict=True, **vision_indices(body.visual, thw, device))
        encoded[modality] = _repeat_images(out, batch["mm_order"][modality], len(thw)) if real else _as_zero_rows(out)
    if encoded:
        kwargs["mm_encoder_outputs"] = encoded
    hidden = body(**kwargs).last_hidden_state[0]  # [T, H]
    return response_log_probs(hidden.index_select(0, batch["resp_index"]), hf.get_output_embeddings(),
                              batch["labels"], temperature, with_entropy, scale_and_cap=logit_scale_and_cap(hf.config))


def vision_indices(tower, grid_thw, device):
    """The index tensors a Qwen-VL vision tower derives from grid_thw [n, 3], computed by transformers' helpers from
    the host grid_thw and moved to `device`. Given them, the tower reads grid_thw only to split its output; without
    them it computes them from a device grid_thw, with about 14 host syncs a call."""
    merge, cu = tower.spatial_merge_size, vision_utils.get_vision_cu_seqlens(grid_thw)
    out = {"position_ids": vision_utils.get_vision_position_ids(grid_thw, merge), "cu_seqlens": cu,
           "max_seqlen": int(cu.diff().max())}
    if getattr(tower, "window_size", None):  # Qwen2.5-VL: most blocks attend within windows
        index, cu_window = vision_utils.get_vision_window_index(grid_thw, merge, tower.window_size, tower.patch_size)
        out.update(window_index=index, cu_window_seqlens=cu_window, max_window_seqlen=int(cu_window.diff().max()))
    if hasattr(tower, "num_grid_per_side"):  # Qwen3-VL: interpolated absolute position embeddings
        out["interp_indices"], out["interp_weights"] = vision_utils.get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size)
    return {k: to_device(v, device) if torch.is_tensor(v) else v for k, v in out.items()}


def to_device(t, device):
    """A host tensor to `device` without a host sync: through pinned memory, copied asynchronously on CUDA (a plain
    .to() waits for the GPU, so the host could not queue the next micro-batch while the GPU runs this one)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def response_log_probs(hidden, lm_head, labels, temperature, with_entropy=False, chunk=HEAD_CHUNK,
                       scale_and_cap=(1.0, None)):
    """hidden [N, H] (the states that predict the response tokens), labels [N] ->
    (logp [N] fp32, entropy [N] fp32 or [0]), with z = softcap(lm_head(h) x scale) / temperature in fp32
    ((scale, cap) = scale_and_cap; softcap(x) = cap tanh(x / cap), or x when cap is None):

        logp_t = z_t[y_t] - logsumexp(z_t)          entropy_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t,v

    Chunks of `chunk` rows, each under activation checkpointing when gradients are on, so at most one
    [chunk, vocab] fp32 block exists at a time (forward and backward). Entropy carries no gradient. No rows still
    go through the head (one empty chunk): every rank's backward must reach every FSDP2 reduction."""
    def head(h, y):
        z = lm_head(h).float()  # [c, V]; one pass over it: x (scale / T), or the cap's tanh and x (cap / T)
        z = torch.tanh(z * (scale / cap)) * (cap / temperature) if cap else z * (scale / temperature)
        logz = torch.logsumexp(z, dim=-1)  # [c]
        logp = z.gather(-1, y[:, None])[:, 0] - logz
        with torch.no_grad():
            ent = logz - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else z.new_zeros(0)
        return logp, ent

    scale, cap = scale_and_cap
    run = functools.partial(checkpoint, head, use_reentrant=False) if torch.is_grad_enabled() else head
    logps, ents = zip(*(run(h, y) for h, y in zip(hidden.split(chunk), labels.split(chunk))))
    return torch.cat(logps), torch.cat(ents)


def logit_scale_and_cap(config):
    """(scale, cap): what the family's ForCausalLM.forward does to lm_head's logits, which the packed pass applies as
    the rollout engine does: x logit_scale (Cohere), / logits_scaling (Granite; x it in HyperCLOVAX), then Gemma's
    final_logit_softcapping. A family that changes them otherwise is not covered (rollout/logp_diff_mean shows it)."""
    text = config.get_text_config()
    scaling = getattr(text, "logits_scaling", None) or 1.0
    scale = (getattr(text, "logit_scale", None) or 1.0) * (scaling if "hyperclovax" in text.model_type else 1 / scaling)
    return scale, getattr(text, "final_logit_softcapping", None)


def _repeat_images(output, order, n_images):
    """A vision output of n_images distinct images with its per-image tuples (pooler_output; Qwen3-VL's
    deepstack_features, one tuple per layer) re-indexed by `order`, so an image shared by several samples of
    the row is encoded once and still fills each sample's placeholders (its gradient sums over them)."""
    if list(order) == list(range(n_images)):
        return output

    def pick(value):
        if isinstance(value, (tuple, list)) and len(value) == n_images and all(torch.is_tensor(v) for v in value):
            return tuple(value[i] for i in order)
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, (tuple, list)) for v in value):
            return [pick(v) for v in value]
        return value

    for key in list(output.keys()):
        output[key] = pick(output[key])
    return output


def _as_zero_rows(output):
    """A vision output with every tensor replaced by zero rows that still depend on the tower (x[:0] + 0 * sum):
    merged into the text as nothing, yet the tower joins the backward like a real image would."""
    leaves = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.is_floating_point()]
    zero = sum(t.float().sum() for t in leaves) * 0.0  # a 0-dim tensor
    return tree_map_only(torch.Tensor, lambda t: t[:0] + zero.to(t.dtype) if t.is_floating_point() else t[:0], output)


# --- Attention: sequence-isolated varlen attention, registered with transformers -----------------------------------

def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function. query [1, Hq, T, D], key / value [1, Hkv, T, D] -> ([1, T, Hq, D], None).
    Boundaries: the vision tower's per-window / per-image `cu_seq_lens_q`, else packed_forward's `packed_cu_seqlens`
    (forward kwargs), else one sequence."""
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError("packed_attention: expects one packed row and no attention mask (it is the padding-free "
                         "path of the actor's packed pass); use attn_implementation='sdpa' for padded batches")
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None:
        cu, max_len = kwargs.get("packed_cu_seqlens"), kwargs.get("packed_max_seqlen")
    if cu is None:
        cu, max_len = torch.tensor([0, query.shape[2]], device=query.device), query.shape[2]
    if (window := kwargs.get("sliding_window")) and int(max_len) > window:  # within it, the window changes nothing
        raise ValueError(f"packed_attention: a sequence of {int(max_len)} tokens is longer than this layer's sliding "
                         f"window ({window} tokens), which it does not apply; lower data.max_prompt_length + "
                         "max_response_length, or drop the window in worker.actor.model.override_config")
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise ValueError(f"packed_attention: {type(module).__name__} caps its attention scores (softcap) or adds sink "
                         "logits (s_aux), which the packed attention does not implement: this family is not supported")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    if torch.is_autocast_enabled(q.device.type):  # rotary embeddings promote q, k to the fp32 of master weights;
        low = torch.get_autocast_dtype(q.device.type)  # the varlen kernels want the compute dtype (no O(T^2) mask)
        q, k, v = q.to(low), k.to(low), v.to(low)
    out = varlen_attention(q, k, v, cu.to(device=q.device, dtype=torch.int32), int(max_len), causal, scaling)
    return out[None], None


@torch.compiler.disable  # a kernel call with Python-side dispatch: a clean break in a compiled decoder layer
def varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal, scale=None):
    """q [T, Hq, D], k / v [T, Hkv, D], sequences at cu_seqlens [n + 1] -> [T, Hq, D]. Backends, logged once: on
    CUDA in bf16/fp16 flash-attn varlen (installed) or torch varlen_attn; else (fp32: neither takes it)
    scaled_dot_product_attention on each sequence: no [T, T] mask, and a NaN in one sequence stays in it."""
    half = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
    if half and (fn := _kernel("flash")) is not None:
        _log_backend("flash-attn flash_attn_varlen_func")
        return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale, causal=causal)
    if half and (fn := _kernel("torch")) is not None:
        _log_backend("torch.nn.attention.varlen.varlen_attn")
        params = inspect.signature(fn).parameters
        kw = {"is_causal": causal} if "is_causal" in params else {"window_size": (-1, 0) if causal else (-1, -1)}
        if k.shape[1] != q.shape[1] and "enable_gqa" in params:
            kw["enable_gqa"] = True  # torch 2.11 took fewer KV heads without the flag
        return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, **kw)
    _log_backend("scaled_dot_product_attention, one sequence at a time")
    bounds = cu_seqlens.tolist()  # [n + 1]
    return torch.cat([F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                     v[a:b].transpose(0, 1), is_causal=causal, scale=scale,
                                                     enable_gqa=k.shape[1] != q.shape[1]).transpose(0, 1)
                      for a, b in zip(bounds[:-1], bounds[1:]) if b > a] or [q[:0]])  # [T, Hq, D]


@functools.cache
def _kernel(name):
    """flash-attn's flash_attn_varlen_func ("flash") or torch's varlen_attn ("torch"), imported once; None if absent."""
    try:
        if name == "flash":
            from flash_attn import flash_attn_varlen_func as fn
        else:
            from torch.nn.attention.varlen import varlen_attn as fn
        return fn
    except ImportError:
        return None


@functools.cache  # once per backend
def _log_backend(name):
    logger.info("actor: attention backend %s", name)


# --- A bf16 AdamW that loses no small step -------------------------------------------------------------------------

class AdamWBF16(torch.optim.Optimizer):
    """AdamW for bf16 weights (optim.strategy=adamw_bf16, as EasyR1's AnyPrecisionAdamW): moments m, v and a
    Kahan compensation c stored in bf16, arithmetic in fp32. Per parameter p, step t:

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        u = -lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd p) + c     the step plus what was lost before
        s = p + u (fp32);   p = bf16(s);   c = s - p                           c: what this write-back lost

    Without c, a step below half a bf16 spacing of p is lost (lr 1e-6 on weights of 0.02, spacing 1.2e-4). On
    FSDP2 shards the arithmetic runs on local tensors and the state stays DTensor (sharded checkpoints)."""

    def __init__(self, params, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            (b1, b2), lr, eps, wd = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    for key in ("exp_avg", "exp_avg_sq", "compensation"):
                        state[key] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                t = state["step"].item()
                x, g = _local(p), _local(p.grad).float()  # [shard]
                m, v, c = (_local(state[k]) for k in ("exp_avg", "exp_avg_sq", "compensation"))
                m32 = m.float().lerp_(g, 1 - b1)
                v32 = v.float().mul_(b2).addcmul_(g, g, value=1 - b2)
                m.copy_(m32)
                v.copy_(v32)
                del g
                u = m32.div_(v32.div_(1 - b2 ** t).sqrt_().add_(eps)).mul_(-lr / (1 - b1 ** t))
                del v32
                s = x.to(torch.float32, copy=True)
                u.add_(s, alpha=-lr * wd).add_(c)
                s.add_(u)
                x.copy_(s)
                c.copy_(s.sub_(x))

    def load_state_dict(self, state_dict):
        """torch's load casts the state to the parameters' dtype (fp32 ones too): back to bf16, as step() needs."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq", "compensation"):
                state[key] = state[key].to(torch.bfloat16)


# --- FLOPs, weights, devices ---------------------------------------------------------------------------------------

def count_flops_params(hf, text_config):
    """Parameter counts for the FLOP estimate: {"body": text parameters but the input embedding (a lookup), counted on
    every token (a mixture's idle experts too: MFU reads high), "head": the LM head (vocab x hidden, also when tied to
    the embedding), "vision": vision tower parameters (per patch), "attention": head_dim x heads x layers}."""
    head = hf.get_output_embeddings().weight
    vision = sum(p.numel() for name, p in hf.named_parameters() if ".visual." in f".{name}")
    body = sum(p.numel() for name, p in hf.named_parameters()
               if ".visual." not in f".{name}" and "embed_tokens" not in name and p is not head)
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return {"body": body, "head": head.numel(), "vision": vision,
            "attention": head_dim * heads * text_config.num_hidden_layers}


def batch_flops(params, batch):
    """Forward + backward FLOPs of a packed batch (recomputation not counted), with P the parameter counts of
    count_flops_params, T the tokens, R the response tokens (the only ones the LM head runs on), L the
    sequence lengths:  6 (P_body T + P_head R + P_vision patches) + 6 d h layers sum(L^2)  (causal attention:
    QK^T and AV are 2 x 2 d h L^2 / 2 FLOPs forward per layer, backward twice that)."""
    squares = sum(length * length for length in batch["seq_lens"])
    patches = sum(v.shape[0] for k, v in batch["mm"].items() if k.startswith("pixel_values"))
    return 6.0 * (params["body"] * sum(batch["seq_lens"]) + params["head"] * sum(batch["resp_lens"])
                  + params["vision"] * patches + params["attention"] * squares)


def peak_tflops(device):
    name = torch.cuda.get_device_name(device)
    peak = next((value for key, value in PEAK_TFLOPS if key in name), None)
    if peak is None:
        logger.warning("actor: unknown GPU %r for perf/mfu_actor; assuming 989 TFLOP/s", name)
    return peak or 989.0


def full_tensor(t, device):
    """A DTensor gathered to a full tensor (moved to `device` first: NCCL cannot gather CPU-offloaded shards)."""
    return t.to(device).full_tensor() if isinstance(t, DTensor) else t.to(device)


class HostCopy:
    """Device tensors parked in host memory between passes (worker.actor.offload.*), the tensor objects kept.

    offload(tensors) copies each tensor's storage into one pinned host buffer (page-locked once, reused every step) and
    frees the device storage by resizing it to 0 bytes (as FSDP2 frees its unsharded parameters): the tensors and
    FSDP2's views of their shards stay valid. onload() reallocates and copies back. Do not read them in between."""

    def __init__(self):
        self.buffer, self.storages, self.sizes = None, [], []

    def offload(self, tensors):
        if self.storages:  # already offloaded
            return
        storages = {s.data_ptr(): s for s in (_local(t).untyped_storage() for t in tensors) if s.nbytes()}  # once each
        self.storages, self.sizes = list(storages.values()), [s.nbytes() for s in storages.values()]
        if self.buffer is None or self.buffer.numel() != sum(self.sizes):
            self.buffer = None  # the old buffer is unpinned and freed before the new one is taken
            self.buffer = _pinned_buffer(sum(self.sizes))
        for s, host in zip(self.storages, self.buffer.split(self.sizes)):
            host.copy_(_as_bytes(s), non_blocking=True)
        if any(s.device.type == "cuda" for s in self.storages):
            torch.cuda.synchronize()
        for s in self.storages:
            s.resize_(0)

    def onload(self):
        if not self.storages:  # nothing offloaded
            return
        for s, host in zip(self.storages, self.buffer.split(self.sizes)):
            s.resize_(host.numel())
            _as_bytes(s).copy_(host, non_blocking=True)  # ordered before the kernels that read it (one stream)
        self.storages, self.sizes = [], []


def _pinned_buffer(nbytes):
    """An uninitialised host buffer of exactly `nbytes`, page-locked with cudaHostRegister (torch's pinned
    allocator rounds each block up to a power of two: up to twice the memory). Pageable if that fails."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes and torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)) == 0:
            weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
        else:
            logger.warning("offload: could not page-lock %.1f GB of host memory; copies run from pageable memory "
                           "(slower)", nbytes / 1e9)
    return buffer


def _as_bytes(storage):
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)  # [storage.nbytes()]


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t
