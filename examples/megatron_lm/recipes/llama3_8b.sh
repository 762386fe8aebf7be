#!/bin/bash
# Megatron-LM's Llama-3 8B recipe (examples/llama/train_llama3_8b_h100_fp8.sh) with FactorEngram:
# every argument and value of that recipe, launched through fe_megatron.megatron_lm.pretrain_gpt with
# the memory's --fe-* arguments added. Lines marked "CPU:" are what a machine without a GPU forces
# (SIZE=cpu, the default here: a tiny model on 2 cores); SIZE=full keeps the recipe's sizes for GPUs
# (NUM_LAYERS=2 shortens the stack, TRAIN_ITERS=3 the run; --exit-interval N, added after the script,
# stops after N steps with a checkpoint).
#
#   DATA_PATH=... TOKENIZER_MODEL=... SAVE=... bash examples/megatron_lm/recipes/llama3_8b.sh [more args]
set -euo pipefail
source "$(dirname "$0")/common.sh"

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

if [ "$SIZE" = full ]; then
    SIZE_ARGS=(--num-layers "${NUM_LAYERS:-32}" --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
               --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
               --micro-batch-size 1 --global-batch-size 128
               --eval-iters 32 --eval-interval 100 --save-interval 1000)
    if [ -n "$TRAIN_ITERS" ]; then
        # TRAIN_ITERS steps of the recipe's batch, the schedule scaled to them (warmup: one step); the
        # datasets' sample indices are then that size, not 1.95 billion samples'
        SIZE_ARGS+=(--train-samples $((TRAIN_ITERS * 128)) --lr-decay-samples $((TRAIN_ITERS * 128))
                    --lr-warmup-samples 128)
    else
        SIZE_ARGS+=(--train-samples 1953125000 --lr-decay-samples 1949218748 --lr-warmup-samples 3906252)
    fi
    if python3 -c 'import transformer_engine' 2> /dev/null; then
        PRECISION_ARGS=(--bf16 --grad-reduce-in-bf16 --fp8-format hybrid --fp8-amax-history-len 1024
                        --fp8-amax-compute-algo max --fp8-param-gather)
        HOST_ONLY_ARGS=(--apply-layernorm-1p --profile --profile-step-start 4 --profile-step-end 6)
    else
        # GPU without Transformer Engine: bf16 on megatron-core's local layers. fp8, --apply-layernorm-1p and
        # the fused rope come from Transformer Engine; the fused softmax and gradient accumulation from
        # Transformer Engine or Apex (the start-up check names each one that is missing)
        PRECISION_ARGS=(--bf16 --grad-reduce-in-bf16)
        HOST_ONLY_ARGS=(--profile --profile-step-start 4 --profile-step-end 6 --transformer-impl local
                        --no-rope-fusion --no-masked-softmax-fusion --no-gradient-accumulation-fusion)
    fi
else
    # CPU: sizes. The recipe's proportions kept: GQA with 4 query heads per group, head size =
    # hidden / heads, FFN = 3.5 x hidden, untied embeddings. Samples for TRAIN_ITERS steps of 4.
    SIZE_ARGS=(--num-layers 4 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4
               --num-query-groups 1 --kv-channels 16 --seq-length 64 --max-position-embeddings 64
               --micro-batch-size 1 --global-batch-size 4
               --train-samples $((TRAIN_ITERS * 4)) --lr-decay-samples $((TRAIN_ITERS * 4 - 2))
               --lr-warmup-samples 4
               --eval-iters 1 --eval-interval "$TRAIN_ITERS" --save-interval "$SAVE_INTERVAL")
    # CPU: fp32. bf16 and fp8 run through Transformer Engine's and the GPU's kernels; fp8 has none on a CPU.
    PRECISION_ARGS=()
    # CPU: --apply-layernorm-1p (a Transformer Engine or Apex norm) and --profile (CUDA's profiler) are
    # left out; the device flags replace the default Transformer Engine layers, NCCL and fused kernels.
    HOST_ONLY_ARGS=($CPU_DEVICE_ARGS)
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
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
)
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
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save "$SAVE"
    --load "$SAVE"
    --tensorboard-dir "$SAVE/tensorboard"
)

torchrun --nproc-per-node "$NPROC" -m fe_megatron.megatron_lm.pretrain_gpt $FE_ARGS \
    "${MODEL_ARGS[@]}" "${SIZE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PRECISION_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DDP_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "${HOST_ONLY_ARGS[@]}" "$@"
