#!/usr/bin/env bash
# Trains the 4K models (#38) in the background-friendly way: stage 1 (1,024-token documents, from the
# 256-token models/lite-256 with its rotary context moved to 4,096), stage 2 (4,096-token documents),
# stage 3p (the same documents with position skipping to 131,072) and stage 3a (its anchored
# continuation, from the committed models/lite-4k-pose-1200; its output models/lite-4k-pose-anchor is the
# shipped default). Each stage resumes from its newest checkpoint when re-run, and a finished stage is
# skipped. One thread by default: the run's sums must not depend on what else the machine is doing
# (docs/training.md), and it leaves a core free (THREADS=2 to use two).
# models/lite-4k is stage 2's output. Stage 3 (1,200 more steps at 4,096, no skipping) was measured at
# 131,072 tokens (44.4%, not shipped): STAGES="3" runs it.
#   bash benchmarks/train_long4k.sh            # stages 1, 2, 3p and 3a, logging to the terminal
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${THREADS:-1}"
for stage in ${STAGES:-1 2 3p 3a}; do
    out="runs/long4k_stage$stage"
    if [ -f "$out/final/model.safetensors" ]; then
        echo "stage $stage: done ($out/final)"
        continue
    fi
    resume=()
    if [ -d "$out/checkpoints" ] && [ -n "$(ls -A "$out/checkpoints" 2>/dev/null)" ]; then
        resume=(--resume)
    fi
    echo "stage $stage: $(date -u +%FT%TZ) start ${resume[*]}"
    gptoss-lite train --config "configs/long4k_stage$stage.yaml" --threads "$THREADS" --no-progress "${resume[@]}"
    echo "stage $stage: $(date -u +%FT%TZ) end"
done
