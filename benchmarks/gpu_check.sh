#!/usr/bin/env bash
# The prepared GPU check: one GRPO and one LOPD step on a Qwen3-4B-shaped random model, or on real
# weights with --model DIR (a folder prepared by `lopd model prepare`: SmolLM2 from `make smollm2`,
# a real Qwen3 folder where one is available); every argument is passed on to gpu_check.py.
# 1. One process under torchrun (train.parallel=fsdp2, which wraps the student only from two
#    processes on: one process trains it unwrapped), rollouts from vLLM colocated with it. It prints the share of the GPU vLLM took
#    (rollout.vllm_gpu_memory_utilization=auto), puts vLLM to sleep during each update
#    (rollout.vllm_sleep), asserts that vLLM serves bf16 (rollout.vllm_dtype=auto under
#    bf16-mixed) and that it generates again after waking.
# 2. With two GPUs: two DDP ranks, each with its own vLLM engine on its own GPU (vLLM's
#    external_launcher backend), the same checks on each.
set -euo pipefail
here="$(dirname "$0")"
"$here/../.venv/bin/torchrun" --nproc_per_node 1 "$here/gpu_check.py" --parallel fsdp2 \
    --engine vllm --vllm-sleep "$@"
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    "$here/../.venv/bin/torchrun" --nproc_per_node 2 "$here/gpu_check.py" --parallel ddp \
        --engine vllm --vllm-sleep "$@"
else
    echo "gpu_check: the two-rank DDP + vLLM part needs two GPUs; skipped on this machine"
fi
