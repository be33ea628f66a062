#!/usr/bin/env bash
# The prepared GPU check: one GRPO and one LOPD step on a Qwen3-4B-shaped random model.
exec "$(dirname "$0")/../.venv/bin/python" "$(dirname "$0")/gpu_check.py" "$@"
