"""rollout.py: n sampled responses per prompt, from one of two engines behind one interface.

    engine = make_rollout(cfg.worker.rollout, model_path, ...)  # cfg.name picks ENGINES["hf" | "vllm"]
    engine.load_weights(actor.named_tensors())                 # before each step's generation and validation
    engine.wake_up()
    responses = engine.generate(prompts, **sampling_settings(cfg), max_tokens=..., seed=seed)  # seed: per round, rank
    engine.sleep()                                             # give the memory back to the actor

Reads worker.rollout (config.py's RolloutConfig) and three attributes the loop adds to it: limit_videos (the most
videos in one row of the data; trainer.py), trust_remote_code and override_config (workers.py). Imports modeling.py
(its dtype names and apply_overrides): take it along to reuse this file.

Prompt keys read (made by data.py): uid; hf: prompt_ids (image and video placeholders expanded),
multi_modal_inputs (MM_KEYS, concatenated over the batch), position_ids ([4, P] Qwen-VL, [1, P] text; optional
for text-only prompts); vllm: raw_prompt_ids (one placeholder per image or video), images, videos (sampled
frames [T, H, W, 3]) and video_metadata.

Each response is a dict:
    prompt_index:   int         index into the prompts given to generate()
    uid:            str         that prompt's uid
    response_ids:   list[int]   up to AND including the first EOS (the generation config's or the tokenizer's)
    logprobs:       list[float] log-prob of each sampled token under the distribution it was sampled from
                                (after the placeholder ban, temperature, top-k and top-p), same length
    finish_reason:  "stop" | "length"   (length = no EOS within max_tokens: truncated)
generate(prompts, n) returns len(prompts) * n of them, grouped: prompt i owns positions i*n .. i*n+n-1.
Sample j of prompt i draws from its own stream, seeded derive_seed(seed, i, j) (vLLM with TP > 1: i and seed are
its TP group's, VLLMRollout). Image and video placeholder tokens are banned: a sampled one breaks the actor's forward.

Both engines hold their OWN copy of the weights (LoRA arrives merged; vLLM's a tensor-parallel slice): ranks decode
different numbers of steps, and a forward of the FSDP-sharded training module would deadlock in its all-gathers.
"""

import functools
import hashlib
import inspect
import os
import warnings

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, DynamicCache,
                          GenerationConfig)
from transformers.core_model_loading import revert_weight_conversion

from modeling import DTYPES, apply_overrides

SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k")
MM_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
# How vLLM gets a video's metadata (its time positions): beside each video, or as the processor's kwargs (README)
VIDEO_METADATA = {"qwen3_vl": "pair", "qwen3_vl_moe": "pair", "qwen2_5_vl": "kwargs"}


def make_rollout(cfg, model_path, *, max_prompt_length, max_response_length, device, tokenizer_path=None,
                 batch_size=64):
    """The engine named by cfg.name, in cfg.dtype (bf16 | fp16 | fp32; not changed on CPU: set fp32 for hf there).
    tokenizer_path: where the generation config / tokenizer live if not in model_path. batch_size: hf only,
    sequences decoded together (memory bound: KV cache of batch_size x (prompt + max_tokens) tokens)."""
    for key, allowed in (("name", ENGINES), ("dtype", DTYPES)):
        if getattr(cfg, key) not in allowed:
            raise ValueError(f"worker.rollout.{key}={getattr(cfg, key)!r} is not one of {sorted(allowed)}")
    return ENGINES[cfg.name](cfg, model_path, max_prompt_length=max_prompt_length, device=device,
                             max_response_length=max_response_length, tokenizer_path=tokenizer_path or model_path,
                             batch_size=batch_size)


def sampling_settings(cfg, override=None):
    """{n, temperature, top_p, top_k} from the config, replaced by `override` (e.g. val_override_config)."""
    if unknown := sorted(set(override or {}) - set(SAMPLING_KEYS)):
        raise ValueError(f"worker.rollout.val_override_config: unknown key(s) {unknown}; allowed {list(SAMPLING_KEYS)}")
    return {**{key: getattr(cfg, key) for key in SAMPLING_KEYS}, **(override or {})}


def derive_seed(*parts):
    """A 62-bit seed from any ints/strings, stable across processes and Python versions (unlike hash())."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class HFRollout:
    """A KV-cache sampling loop over left-padded batches, on its own copy of the model, refreshed in place by
    load_weights(). Positions come from the prompt (data.py's mrope rows for Qwen-VL) and continue at
    last_prompt_position + 1, + 2, ... on every row, as the actor extends them: batched and one-by-one agree."""

    def __init__(self, cfg, model_path, *, max_prompt_length, max_response_length, device, tokenizer_path,
                 batch_size=64):
        remote = getattr(cfg, "trust_remote_code", False)  # set by workers.py (module docstring)
        config, _, self.eos_ids, self.banned_ids, self.pad_id = _load_config(cfg, model_path, tokenizer_path)
        is_vl = getattr(config, "vision_config", None) is not None
        model_class = AutoModelForImageTextToText if is_vl else AutoModelForCausalLM
        self.model = model_class.from_pretrained(model_path, config=config, dtype=DTYPES[cfg.dtype],
                                                 trust_remote_code=remote).to(device).eval().requires_grad_(False)
        self.device, self.max_response_length, self.batch_size = torch.device(device), max_response_length, batch_size
        self.ignore_eos, self.position_rows = cfg.ignore_eos, 4 if is_vl else 1  # rows: text + 3 mrope for Qwen-VL
        self.new_cache = lambda: DynamicCache(config=config.get_text_config())
        # the forward's cache argument: `cache` in later transformers 5.x, `past_key_values` before
        self.cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=None, seed=0):
        """For training keep top_p=1, top_k=-1: the actor's full softmax does not match truncated log-probs."""
        max_tokens = self.max_response_length if max_tokens is None else max_tokens
        _check_sampling(prompts, n, temperature, top_p, max_tokens, key="prompt_ids")
        self.wake_up()
        rows = [(i, j) for i in range(len(prompts)) for j in range(n)]  # grouped: prompt i, sample j
        batches = [rows[k:k + self.batch_size] for k in range(0, len(rows), self.batch_size)]
        return [r for batch in batches for r in self._generate_batch(prompts, batch, temperature, top_p, top_k,
                                                                     max_tokens, seed)]

    @torch.no_grad()
    def _generate_batch(self, prompts, rows, temperature, top_p, top_k, max_tokens, seed):
        dev, B = self.device, len(rows)
        left_pad = functools.partial(torch.nn.utils.rnn.pad_sequence, batch_first=True, padding_side="left")
        ids = [torch.as_tensor(prompts[i]["prompt_ids"]) for i, _ in rows]
        input_ids = left_pad(ids, padding_value=self.pad_id).to(dev)                 # [B, P]
        mask = left_pad([torch.ones_like(x) for x in ids]).to(dev)                   # [B, P] 1 = real token
        positions = left_pad([self._prompt_positions(prompts[i], i).T for i, _ in rows])  # [B, P, R]
        positions = positions.permute(2, 0, 1).to(dev)                               # [R, B, P]
        # Per-image tensors concatenated in row order: the placeholders are filled in that order.
        inputs = [prompts[i].get("multi_modal_inputs") or {} for i, _ in rows]
        mm = {key: torch.cat([x[key] for x in inputs if key in x]).to(dev)
              for key in MM_KEYS if any(key in x for x in inputs)}
        generators = [torch.Generator(device=dev).manual_seed(derive_seed(seed, i, j)) for i, j in rows]
        cache = self.new_cache()
        logits = self._forward(input_ids, mask, positions, cache, mm)                # [B, vocab]
        alive, eos = torch.ones(B, dtype=torch.bool, device=dev), torch.tensor(self.eos_ids, device=dev)
        steps = []  # per step: (token [B], log-prob [B])
        for step in range(max_tokens):
            steps.append(_sample_next(logits, self.banned_ids, temperature, top_p, top_k, generators))
            token = steps[-1][0]
            if not self.ignore_eos:
                alive &= ~torch.isin(token, eos)
            if step + 1 == max_tokens or not alive.any():
                break
            mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)                     # [B, P + step + 1]
            next_positions = positions[:, :, -1:] + step + 1                         # [R, B, 1]
            logits = self._forward(token[:, None], mask, next_positions, cache, {})
        tokens, logprobs = (torch.stack(column, 1).tolist() for column in zip(*steps))  # [B, T] each
        return [_response(i, prompts[i]["uid"], tokens[b], logprobs[b], self.eos_ids) for b, (i, _) in enumerate(rows)]

    def _forward(self, input_ids, mask, positions, cache, mm):
        """Last-position logits in fp32 [B, vocab]; `cache` grows in place."""
        position_ids = positions[0] if self.position_rows == 1 else positions       # [B, L] or [4, B, L]
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                         logits_to_keep=1, **{self.cache_kwarg: cache}, **mm)
        return out.logits[:, -1].float()

    def _prompt_positions(self, prompt, index):
        """[R, P] positions of one prompt: its own position_ids, or 0..P-1 for a text-only prompt."""
        length, positions, mm = len(prompt["prompt_ids"]), prompt.get("position_ids"), prompt.get("multi_modal_inputs")
        if not mm and not set(self.banned_ids).isdisjoint(map(int, prompt["prompt_ids"])):  # else read as text
            raise ValueError(f"prompt {index} (uid {prompt.get('uid')}): image or video placeholders in prompt_ids "
                             "but no multi_modal_inputs (data.py's processor output)")
        if positions is None and not mm:
            positions = torch.arange(length)[None]
        shape = None if positions is None else tuple(torch.as_tensor(positions).shape)
        if shape != (self.position_rows, length) and (mm or shape != (1, length)):  # text-only: (1, P) expands too
            raise ValueError(f"prompt {index} (uid {prompt.get('uid')}): position_ids of shape {shape}, expected "
                             f"({self.position_rows}, {length}){'' if mm else f' or (1, {length})'}; image prompts "
                             "need data.py's mrope position_ids [4, P]")
        return torch.as_tensor(positions).expand(self.position_rows, -1)

    @torch.no_grad()
    def load_weights(self, named_tensors):
        """Copy (name, tensor) pairs into the model in place; names are the HF model's own state_dict names."""
        self.wake_up()  # load straight into the device copy
        params, unknown = self.model.state_dict(), []  # params: name -> tensor sharing storage with the model
        for name, tensor in named_tensors:
            if name not in params:
                unknown.append(name)
            elif params[name].shape != tensor.shape:
                raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, the rollout model "
                                 f"expects {tuple(params[name].shape)}")
            else:
                params[name].copy_(tensor)
        if unknown:
            raise KeyError(f"load_weights: {len(unknown)} name(s) unknown to the rollout model "
                           f"{type(self.model).__name__}: {unknown[:8]}; expected e.g. {list(params)[:3]}. "
                           f"Send the HF model's own state_dict names (LoRA: merged weights, no peft prefixes).")

    def sleep(self):
        """Move the weights to the CPU so the actor can use the GPU (nothing to do on a CPU run)."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self):
        self.model.to(self.device)


def _sample_next(logits, banned_ids, temperature, top_p, top_k, generators):
    """One token per row from logits [B, vocab] (modified in place), and its log-prob.

        z = logits with z[banned] = -inf;    greedy (temperature 0): token = argmax z, logp = log_softmax(z)
        otherwise: z = z / temperature; top-k keeps the k largest; top-p keeps the most likely tokens whose
        preceding mass is < top_p, and the ties of the last one kept (equally likely tokens go together, as in
        top-k, whatever a sort's order); logp = log_softmax(z) (the truncated distribution); token ~ exp(logp)
        by the exponential race  token = argmax_v p_v / E_v,  E_v ~ Exp(1) drawn with the row's own
        generator: a row's draw does not depend on its batch, and unlike torch.multinomial per row it
        needs no host sync (1.5x the decode speed at batch 64 on a GPU).
    """
    logits[:, banned_ids] = float("-inf")
    if temperature == 0:
        token = logits.argmax(-1)
        return token, logits.log_softmax(-1).gather(1, token[:, None])[:, 0]
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]                              # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits = logits.sort(-1, descending=True).values
        probs = sorted_logits.softmax(-1)
        last_kept = sorted_logits.masked_fill(probs.cumsum(-1) - probs >= top_p, float("inf")).amin(-1, keepdim=True)
        logits = logits.masked_fill(logits < last_kept, float("-inf"))  # last_kept [B, 1]: min over mass before < top_p
    logp = logits.log_softmax(-1)                                                    # [B, vocab]
    race = torch.stack([torch.empty_like(logp[0]).exponential_(generator=g) for g in generators])  # [B, vocab]
    token = (logp.exp() / race).argmax(-1)
    return token, logp.gather(1, token[:, None])[:, 0]


class VLLMRollout:
    """vLLM >= 0.11 in this process (SPMD, external_launcher; one engine per TP group, colocated with the actor),
    weights synced from the actor (load_format="dummy": random until then); checked on vLLM 0.24.0.

    Memory: asleep (level 1: weights offloaded, KV cache freed) outside generation; a step runs load_weights()
    [weights only] -> wake_up() [KV cache] -> generate() -> sleep(). Every rank of a TP group must feed vLLM the
    same requests: generate() all-gathers the group's prompts, generates once with the first rank's seed and returns
    this rank's share. Needs the workers' torch.distributed environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""

    def __init__(self, cfg, model_path, *, max_prompt_length, max_response_length, device, tokenizer_path,
                 batch_size=None):
        self.cfg, self.max_response_length = cfg, max_response_length
        config, overrides, self.eos_ids, self.banned_ids, _ = _load_config(cfg, model_path, tokenizer_path)
        max_model_len, text = cfg.max_model_len or max_prompt_length + max_response_length, config.get_text_config()
        context = getattr(text, "max_position_embeddings", 0)  # with rope scaling vLLM allows more: its own check
        if 0 < context < max_model_len and "factor" not in (getattr(text, "rope_parameters", None) or {}) \
                and not os.getenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
            raise ValueError(f"vLLM's context of {max_model_len} tokens (worker.rollout.max_model_len, else data."
                             f"max_prompt_length + max_response_length) exceeds the {context} positions of {model_path}"
                             " (max_position_embeddings in its config.json), which vLLM refuses; lower it")
        try:
            import vllm
        except ImportError as error:
            raise ImportError("worker.rollout.name=vllm needs vLLM >= 0.11: pip install -r requirements-gpu.txt "
                              "(or set worker.rollout.name=hf)") from error

        self.SamplingParams, self.bias = vllm.SamplingParams, {t: -100.0 for t in self.banned_ids} or None
        limits = {"video": getattr(cfg, "limit_videos", 0)}  # 0: no memory profiled or reserved for a video
        limits |= {"image": cfg.limit_images} if cfg.limit_images > 0 else {}
        self.metadata_as = VIDEO_METADATA.get(config.model_type)  # "pair", "kwargs" or None
        extra = {"limit_mm_per_prompt": limits} if hasattr(config, "vision_config") else {}
        self.llm = vllm.LLM(
            model=model_path, tokenizer=tokenizer_path, load_format="dummy",
            dtype=str(DTYPES[cfg.dtype]).removeprefix("torch."),
            distributed_executor_backend="external_launcher", tensor_parallel_size=cfg.tensor_parallel_size,
            enable_sleep_mode=True, gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager, enable_chunked_prefill=cfg.enable_chunked_prefill,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=max_model_len,
            seed=cfg.seed, disable_log_stats=cfg.disable_log_stats, disable_custom_all_reduce=True,
            logprobs_mode="processed_logprobs",  # log-probs after bias, temperature, top-k/p
            trust_remote_code=getattr(cfg, "trust_remote_code", False), hf_overrides=overrides, **extra)
        self.llm.sleep(level=1)
        self.asleep, self.synced = {"weights", "kv_cache"}, False
        auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
        with torch.device("meta"):  # transformers' model of the config: which tensors its save splits or fuses
            self.meta = auto.from_config(config, trust_remote_code=getattr(cfg, "trust_remote_code", False))
        self.saved_names, self.converted = {}, set()  # what transformers' save renames, and what it splits or changes
        for name, t in self.meta.state_dict().items():  # (Qwen2.5-VL's and Mixtral's layouts; a mixture's experts)
            saved = revert_weight_conversion(self.meta, {name: t})
            if len(saved) == 1 and next(iter(saved.values())) is t:  # the same tensor, maybe under another name
                self.saved_names[name] = next(iter(saved))
            else:
                self.converted.add(name)

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=None, seed=0):
        """As HFRollout.generate. The log-probs are vLLM's processed_logprobs (after the placeholder bias of
        -100, temperature, top-k and top-p); -100 rather than -inf, as vLLM's logit_bias is additive."""
        if not self.synced:
            raise RuntimeError("the vLLM rollout holds random weights (load_format='dummy'): call "
                               "load_weights(actor.named_tensors()) before the first generate()")
        max_tokens = self.max_response_length if max_tokens is None else max_tokens
        _check_sampling(prompts, n, temperature, top_p, max_tokens, key="raw_prompt_ids")
        self.wake_up()
        mine = [{key: list(p.get(key) or []) for key in ("raw_prompt_ids", "images", "videos", "video_metadata")}
                | {"uid": p["uid"]} for p in prompts]  # only what vLLM needs travels to the TP peers
        group, offset, seed = self._gather_tp_group(mine, seed)  # each rank brings its own share
        requests = []
        for prompt in group:
            videos, metadata = prompt["videos"], prompt["video_metadata"]
            if videos and self.metadata_as == "pair":  # frames sampled by data.py: vLLM must not sample again
                videos = [(v, {**m, "do_sample_frames": False}) for v, m in zip(videos, metadata)]
            media = {kind: items for kind, items in (("image", prompt["images"]), ("video", videos)) if items}
            request = {"prompt_token_ids": prompt["raw_prompt_ids"]} | ({"multi_modal_data": media} if media else {})
            if videos and self.metadata_as == "kwargs":
                request["mm_processor_kwargs"] = {"video_metadata": metadata}
            requests += [request] * n
        params = [self.SamplingParams(  # n requests of one sample each (sample j of prompt i: k = i * n + j)
            n=1, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
            seed=derive_seed(seed, k // n, k % n), logprobs=0, detokenize=False, ignore_eos=self.cfg.ignore_eos,
            stop_token_ids=[] if self.cfg.ignore_eos else list(self.eos_ids), logit_bias=self.bias)
            for k in range(len(requests))]
        outputs = self.llm.generate(requests, params, use_tqdm=not self.cfg.disable_tqdm) if requests else []
        responses = []
        for k in range(offset * n, (offset + len(prompts)) * n):  # this rank's share, in order
            out = outputs[k].outputs[0]
            logprobs = [step[token].logprob for token, step in zip(out.token_ids, out.logprobs)]
            responses.append(_response(k // n - offset, group[k // n]["uid"], out.token_ids, logprobs, self.eos_ids))
        return responses

    def _gather_tp_group(self, prompts, seed):
        """(the TP group's prompts, where this rank's start, the group's seed)."""
        tp = _vllm_internals(self.llm)["tp_group"]
        if tp is None or tp.world_size == 1:
            return prompts, 0, seed
        gathered = [None] * tp.world_size
        torch.distributed.all_gather_object(gathered, (prompts, seed), group=tp.cpu_group)
        offset = sum(len(p) for p, _ in gathered[:tp.rank_in_group])
        return [p for part, _ in gathered for p in part], offset, gathered[0][1]

    def load_weights(self, named_tensors):
        """Stream (HF name, full tensor) pairs into vLLM's own loader (it slices for TP, fuses qkv / gate_up, maps HF
        names of Qwen2/2.5/3-VL and text LMs), waking only the weights: no KV cache beside the actor's gathers. Each
        tensor goes as transformers' save writes it, the checkpoint layout vLLM reads: renamed (Qwen2.5-VL's
        `visual.`, Mixtral's `block_sparse_moe.gate`), a mixture's fused experts split one per expert."""
        self.wake_up(tags={"weights"})
        _vllm_internals(self.llm)["model"].load_weights(
            pair for name, t in named_tensors for pair in (revert_weight_conversion(self.meta, {name: t}).items()
                                                           if name in self.converted else
                                                           [(self.saved_names.get(name, name), t)]))
        self.synced = True

    def wake_up(self, tags=frozenset({"weights", "kv_cache"})):
        if self.asleep & tags:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=sorted(self.asleep & tags))
            self.asleep -= tags

    def sleep(self):
        """Reset the prefix and encoder caches (they hold results of the current weights), then sleep(level=1).
        vLLM's sleep releases every allocation: an engine with only its weights awake wakes its KV cache first."""
        if self.asleep == {"weights", "kv_cache"}:
            return
        self.wake_up()
        self.llm.reset_prefix_cache()
        if (reset_encoder_cache := _vllm_internals(self.llm)["reset_encoder_cache"]) is not None:
            reset_encoder_cache()
        else:
            warnings.warn("this vLLM has no reset_encoder_cache(): a repeated image may reuse vision embeddings "
                          "of earlier weights; upgrade vLLM (checked on 0.24.0)", stacklevel=2)
        self.llm.sleep(level=1)
        torch.cuda.empty_cache()
        self.asleep = {"weights", "kv_cache"}


def _vllm_internals(llm):
    """THE one place that reaches into vLLM's private objects (checked on vLLM 0.24.0). model: the nn.Module
    whose load_weights() takes HF names; reset_encoder_cache: the engine's own, None on an older vLLM; tp_group:
    vLLM's tensor-parallel GroupCoordinator."""
    from vllm.distributed import parallel_state

    engine = llm.llm_engine
    return {"model": engine.model_executor.driver_worker.worker.model_runner.model,
            "reset_encoder_cache": getattr(engine, "reset_encoder_cache", None),
            "tp_group": parallel_state.get_tp_group() if parallel_state.model_parallel_is_initialized() else None}


def _response(prompt_index, uid, token_ids, logprobs, eos_ids):
    """A response dict cut after its first EOS ("stop"); without one it is truncated ("length")."""
    end = next((t + 1 for t, token in enumerate(token_ids) if token in eos_ids), None)
    return {"prompt_index": prompt_index, "uid": uid, "response_ids": list(token_ids[:end]),
            "logprobs": list(logprobs[:end]), "finish_reason": "length" if end is None else "stop"}


def _load_config(cfg, model_path, tokenizer_path):
    """(the model's config with cfg.override_config, the values it set (apply_overrides), EOS ids: the generation
    config's and the tokenizer's, placeholder ids to ban, pad id)."""
    trust_remote_code = getattr(cfg, "trust_remote_code", False)
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    overrides = apply_overrides(config, getattr(cfg, "override_config", None))
    try:  # the model's own generation config (vLLM and the saved checkpoints read it), else the tokenizer folder's
        try:
            generation = GenerationConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except OSError:
            generation = GenerationConfig.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
        eos, pad = generation.eos_token_id, generation.pad_token_id
    except OSError:  # no generation_config.json: the tokenizer's
        eos = pad = None
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    eos += [tokenizer.eos_token_id] if tokenizer.eos_token_id not in (None, *eos) else []  # vLLM stops there too
    pad = tokenizer.pad_token_id if pad is None else pad
    if not eos:
        raise ValueError(f"no EOS token id in the generation config or tokenizer at {tokenizer_path}")
    banned = [getattr(config, key, None) for key in ("image_token_id", "video_token_id")]
    return config, overrides, eos, [t for t in banned if t is not None], eos[0] if pad is None else pad


def _check_sampling(prompts, n, temperature, top_p, max_tokens, key):
    if n < 1 or max_tokens < 1 or not temperature >= 0 or not 0 < top_p <= 1:
        raise ValueError(f"rollout sampling settings out of range: n={n} (>= 1), max_tokens={max_tokens} (>= 1), "
                         f"temperature={temperature} (>= 0), top_p={top_p} (in (0, 1])")
    for i, prompt in enumerate(prompts):
        if missing := [k for k in (key, "uid") if k not in prompt]:
            raise KeyError(f"prompt {i} lacks {missing} (has {sorted(prompt)}); data.py makes them")
        if not len(prompt[key]):
            raise ValueError(f"prompt {i} (uid {prompt['uid']}) has an empty {key}")


ENGINES = {"hf": HFRollout, "vllm": VLLMRollout}
