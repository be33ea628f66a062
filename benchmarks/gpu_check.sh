#!/usr/bin/env bash
# The prepared GPU check: one GRPO and one LOPD step on a Qwen3-4B-shaped random model.
# One process under torchrun: the student wrapped by FSDP2 on the GPU, rollouts from vLLM.
exec "$(dirname "$0")/../.venv/bin/torchrun" --nproc_per_node 1 "$(dirname "$0")/gpu_check.py" --parallel fsdp2 --engine vllm "$@"
