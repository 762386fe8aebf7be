#!/bin/bash
# Megatron-LM's Llama-3 8B recipe under Megatron-FSDP (examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh)
# with FactorEngram: every argument and value of that recipe (USE_MEGATRON_FSDP=1, its default), launched
# through fe_megatron.megatron_lm.pretrain_gpt with the memory's --fe-* arguments added. The backbone is
# sharded by Megatron-FSDP (optim_grads_params); the tables stay in stores beside it, whole or row-sharded
# (--fe-table-sharding rows), and are checkpointed beside its fsdp_dtensor checkpoint. Lines marked "CPU:"
# are what a machine without a GPU forces (SIZE=cpu, the default: a tiny model on 2 processes); SIZE=full
# keeps the recipe's sizes (NUM_LAYERS, TRAIN_ITERS shorten it). Lines marked "memory:" are what the
# memory cannot run beside.
#
# USE_MEGATRON_FSDP=0 runs the recipe's DDP branch instead (the distributed optimizer, torch_dist checkpoints).
#
#   DATA_PATH=... TOKENIZER_MODEL=... SAVE=... bash examples/megatron_lm/recipes/llama3_8b_fsdp.sh [more args]
set -euo pipefail
# Megatron-FSDP shards over data-parallel ranks and refuses one: two processes by default
NPROC=${NPROC:-2}
USE_MEGATRON_FSDP=${USE_MEGATRON_FSDP:-1}
source "$(dirname "$0")/common.sh"

if [ "$SIZE" = full ]; then
    SIZE_ARGS=(--num-layers "${NUM_LAYERS:-32}" --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
               --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
               --micro-batch-size 1 --global-batch-size 128
               --eval-iters 32 --eval-interval 100 --save-interval 1000)
    if [ -n "$TRAIN_ITERS" ]; then  # as llama3_8b.sh: TRAIN_ITERS steps of the recipe's batch
        SIZE_ARGS+=(--train-samples $((TRAIN_ITERS * 128)) --lr-decay-samples $((TRAIN_ITERS * 128))
                    --lr-warmup-samples 128)
    else
        SIZE_ARGS+=(--train-samples 1953125000 --lr-decay-samples 1949218748 --lr-warmup-samples 3906252)
    fi
    PRECISION_ARGS=(--bf16)
    HOST_ONLY_ARGS=()
    FSDP_HOST_ARGS=(--use-nccl-ub --fsdp-manual-registration)
    if python3 -c 'import transformer_engine' 2> /dev/null; then
        PRECISION_ARGS+=(--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
                         --fp8-param-gather)
        HOST_ONLY_ARGS+=(--apply-layernorm-1p)
    else  # GPU without Transformer Engine: as llama3_8b.sh
        HOST_ONLY_ARGS+=(--transformer-impl local --no-rope-fusion --no-masked-softmax-fusion
                         --no-gradient-accumulation-fusion)
    fi
else
    # CPU: sizes, as llama3_8b.sh (GQA, untied embeddings), global batch 4 over 2 data-parallel ranks, but
    # FFN = 4 x hidden: Megatron-FSDP cuts each weight's shard at a row of it, which 224-wide rows at this
    # size miss (megatron-core 0.19.2 fails stock: "shape '[-1, 224]' is invalid for input of size 4096")
    SIZE_ARGS=(--num-layers 4 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4
               --num-query-groups 1 --kv-channels 16 --seq-length 64 --max-position-embeddings 64
               --micro-batch-size 1 --global-batch-size 4
               --train-samples $((TRAIN_ITERS * 4)) --lr-decay-samples $((TRAIN_ITERS * 4 - 2))
               --lr-warmup-samples 4
               --eval-iters 1 --eval-interval "$TRAIN_ITERS" --save-interval "$SAVE_INTERVAL")
    # CPU: fp32 (the recipe's bf16 and fp8 run on the GPU's kernels).
    PRECISION_ARGS=()
    # CPU: --use-nccl-ub and --fsdp-manual-registration (NCCL's user buffers) and --apply-layernorm-1p are
    # left out; gloo has no pre-multiplied sum (--no-gradient-reduce-div-fusion); the device flags replace
    # the Transformer Engine layers, NCCL and fused kernels.
    HOST_ONLY_ARGS=($CPU_DEVICE_ARGS)
    FSDP_HOST_ARGS=(--no-gradient-reduce-div-fusion)
fi

MODEL_ARGS=(
    --use-mcore-models
    --group-query-attention
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --normalization RMSNorm
    --init-method-std 0.0134
    --attention-backend fused
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)
TRAINING_ARGS=(
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --cross-entropy-loss-fusion
    --no-check-for-nan-in-loss-and-grad
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
)
if [ "$USE_MEGATRON_FSDP" = 1 ]; then
    unset CUDA_DEVICE_MAX_CONNECTIONS  # Megatron-FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1
    # memory: --init-model-with-meta-device is left out: the tables move into stores as the model is
    # built, which needs their values (the start-up check refuses it with memory)
    FSDP_ARGS=(
        --use-megatron-fsdp
        --data-parallel-sharding-strategy optim_grads_params
        --no-gradient-accumulation-fusion
        --calculate-per-token-loss
        --ckpt-format fsdp_dtensor
        --fsdp-double-buffer
        "${FSDP_HOST_ARGS[@]}"
    )
else
    FSDP_ARGS=()
fi
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --context-parallel-size 1
    --sequence-parallel
)
DDP_ARGS=(
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)
# the recipe's real-data branch; its HuggingFaceTokenizer (and --vocab-size 128256) are replaced by the
# fe-data SentencePiece model the data was made with
DATA_ARGS=(
    --data-path "$DATA_PATH"
    --tokenizer-type SentencePieceTokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
    --data-cache-path "$SAVE/data_cache"
    --split 99,1,0
    --no-create-attention-mask-in-dataloader
    --no-mmap-bin-files
    --num-workers 1
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --log-throughput
    --logging-level 20
    --distributed-timeout-minutes 60
    --save "$SAVE"
    --load "$SAVE"
    --tensorboard-dir "$SAVE/tensorboard"
)

torchrun --nproc-per-node "$NPROC" -m fe_megatron.megatron_lm.pretrain_gpt $FE_ARGS \
    "${MODEL_ARGS[@]}" "${SIZE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PRECISION_ARGS[@]}" "${FSDP_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" "${DDP_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${HOST_ONLY_ARGS[@]}" "$@"
