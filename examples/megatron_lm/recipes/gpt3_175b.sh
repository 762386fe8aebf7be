#!/bin/bash
# Megatron-LM's GPT-3 175B recipe (examples/gpt3/train_gpt3_175b_distributed.sh) with FactorEngram:
# every argument and value of that recipe, launched through fe_megatron.megatron_lm.pretrain_gpt with
# the memory's --fe-* arguments added. Lines marked "CPU:" are what a machine without a GPU forces
# (SIZE=cpu, the default: a tiny model on 2 cores); SIZE=full keeps the recipe's sizes for GPUs.
#
#   DATA_PATH=... TOKENIZER_MODEL=... SAVE=... bash examples/megatron_lm/recipes/gpt3_175b.sh [more args]
#
# Two changes beyond size, both because the recipe does not run as written on megatron-core 0.19.2:
# - --step-batch-size-schedule is left out: 0.19.2 refuses it beside --global-batch-size ("Cannot specify
#   both"), and the schedule's ramp (16 to 1536 sequences over 12B tokens) has no CPU-sized form anyway;
# - --split 949,50,1 gives a small corpus' test part no document (1 in 1000; megatron.core would loop
#   forever, fe_megatron refuses it by name): 949,50,10 on CPU, the recipe's with SIZE=full.
# The GPT-3 backbone (learned positions, LayerNorm, GELU, biases) has no Hugging Face form here: the run
# says so at start-up, and its checkpoints resume but do not convert.
set -euo pipefail
source "$(dirname "$0")/common.sh"

export CUDA_DEVICE_MAX_CONNECTIONS=1
SPLIT=${SPLIT:-$([ "$SIZE" = full ] && echo 949,50,1 || echo 949,50,10)}

if [ "$SIZE" = full ]; then
    SIZE_ARGS=(--num-layers "${NUM_LAYERS:-96}" --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
               --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1536
               --train-iters 500000 --lr-decay-iters 430000
               --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
               --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10)
    PRECISION_ARGS=(--fp16)
    HOST_ONLY_ARGS=(--attention-backend auto)
else
    # CPU: sizes (the recipe's proportions: head size = hidden / heads, FFN = 4 x hidden by default)
    SIZE_ARGS=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64
               --max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 4
               --train-iters "$TRAIN_ITERS" --lr-decay-iters "$TRAIN_ITERS"
               --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size 1
               --log-interval 1 --save-interval "$SAVE_INTERVAL" --eval-interval "$TRAIN_ITERS" --eval-iters 1)
    # CPU: fp32. fp16 with its loss scaling runs on a GPU's half-precision units.
    PRECISION_ARGS=()
    HOST_ONLY_ARGS=($CPU_DEVICE_ARGS)
fi

TRAINING_ARGS=(
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
)
# the recipe's GPT-2 BPE files (--vocab-file, --merge-file) are replaced by the fe-data SentencePiece model
DATA_ARGS=(
    --data-path "$DATA_PATH"
    --tokenizer-type SentencePieceTokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
    --split "$SPLIT"
)
EVAL_AND_LOGGING_ARGS=(
    --save "$SAVE"
    --load "$SAVE"
    --tensorboard-dir "$SAVE/tensorboard"
)

torchrun --nproc-per-node "$NPROC" -m fe_megatron.megatron_lm.pretrain_gpt $FE_ARGS \
    "${SIZE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PRECISION_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${HOST_ONLY_ARGS[@]}" "$@"
