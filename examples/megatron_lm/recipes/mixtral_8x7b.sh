#!/bin/bash
# Megatron-LM's Mixtral 8x7B recipe (examples/mixtral/train_mixtral_8x7b_distributed.sh) with FactorEngram:
# every argument and value of that recipe, launched through fe_megatron.megatron_lm.pretrain_gpt with
# the memory's --fe-* arguments added. Lines marked "CPU:" are what a machine without a GPU forces
# (SIZE=cpu, the default: a tiny model on 2 cores); SIZE=full keeps the recipe's sizes for GPUs.
#
#   DATA_PATH=... TOKENIZER_MODEL=... SAVE=... bash examples/megatron_lm/recipes/mixtral_8x7b.sh [more args]
#
# An MoE backbone has no Hugging Face form here (the Hugging Face model's FFN is dense): the run says so
# at start-up, and its checkpoints resume but do not convert.
set -euo pipefail
source "$(dirname "$0")/common.sh"

export CUDA_DEVICE_MAX_CONNECTIONS=1
# the recipe's --split 99990,8,2 gives a small corpus' validation and test parts no document (megatron.core
# would loop forever; fe_megatron refuses it by name): 980,10,10 on CPU, SPLIT=99990,8,2 for 50,000+ documents
SPLIT=${SPLIT:-$([ "$SIZE" = full ] && echo 99990,8,2 || echo 980,10,10)}

if [ "$SIZE" = full ]; then
    SIZE_ARGS=(--seq-length 4096 --max-position-embeddings 32768 --num-layers "${NUM_LAYERS:-32}" --hidden-size 4096
               --ffn-hidden-size 14336 --num-attention-heads 32 --num-query-groups 8
               --micro-batch-size 1 --global-batch-size 256 --train-iters 500000 --lr-decay-iters 320000
               --lr-warmup-iters 500 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
               --save-interval 10000 --eval-interval 1000 --eval-iters 10)
    PRECISION_ARGS=(--bf16)
    HOST_ONLY_ARGS=(--moe-grouped-gemm --moe-token-dispatcher-type alltoall)
else
    # CPU: sizes (8 experts, top-2, GQA with 4 query heads per group, FFN = 3.5 x hidden). One process:
    # the recipe's PP=4 x EP=8 needs 32 ranks (PP=$PP and EP=$EP choose others).
    SIZE_ARGS=(--seq-length 64 --max-position-embeddings 512 --num-layers 4 --hidden-size 64
               --ffn-hidden-size 224 --num-attention-heads 4 --num-query-groups 1
               --micro-batch-size 1 --global-batch-size 4 --train-iters "$TRAIN_ITERS"
               --lr-decay-iters "$TRAIN_ITERS" --lr-warmup-iters 1
               --pipeline-model-parallel-size "${PP:-1}" --expert-model-parallel-size "${EP:-1}"
               --save-interval "$SAVE_INTERVAL" --eval-interval "$TRAIN_ITERS" --eval-iters 1)
    # CPU: fp32 (bf16 runs on a GPU's tensor cores)
    PRECISION_ARGS=()
    # CPU: --moe-grouped-gemm runs grouped CUDA GEMMs (the recipe's all-to-all dispatcher runs on gloo)
    HOST_ONLY_ARGS=($CPU_DEVICE_ARGS --moe-token-dispatcher-type alltoall)
fi

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)
MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --overlap-param-gather
    --overlap-grad-reduce
)
# the recipe's Llama2Tokenizer is replaced by the fe-data SentencePiece model the data was made with
DATA_ARGS=(
    --tokenizer-type SentencePieceTokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
    --data-path "$DATA_PATH"
    --split "$SPLIT"
)
TRAINING_ARGS=(
    --lr 1e-4
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --clip-grad 1.0
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --use-distributed-optimizer
    --sequence-parallel
)
LOGGING_ARGS=(
    --log-interval 1
    --save "$SAVE"
    --load "$SAVE"
    --tensorboard-dir "$SAVE/tensorboard"
    --no-load-optim
    --no-load-rng
)

torchrun --nproc-per-node "$NPROC" -m fe_megatron.megatron_lm.pretrain_gpt $FE_ARGS \
    "${MODEL_ARGS[@]}" "${SIZE_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${PRECISION_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "${HOST_ONLY_ARGS[@]}" "$@"
