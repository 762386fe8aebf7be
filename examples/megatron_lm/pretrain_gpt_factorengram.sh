#!/bin/bash
# pretrain_gpt.sh with FactorEngram: the launch line names fe_megatron.megatron_lm.pretrain_gpt and the
# memory (FE_MEMORY_ARGS); every other line is unchanged. No Megatron-LM checkout is needed.
set -euo pipefail

NPROC=${NPROC:-8}
DATA_PATH=${DATA_PATH:?set DATA_PATH to the --data-path prefix (fe-data preprocess or preprocess_data.py)}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a SentencePiece .model file}
SAVE=${SAVE:-checkpoints/gpt}
FE_MEMORY_ARGS=${FE_MEMORY_ARGS:---fe-memory-preset factorengram-340m}
DEVICE_ARGS=${DEVICE_ARGS:---bf16 --transformer-impl transformer_engine}

MODEL_ARGS=(--num-layers 24 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16
            --seq-length 2048 --max-position-embeddings 2048 --swiglu --normalization RMSNorm
            --disable-bias-linear --position-embedding-type rope --hidden-dropout 0 --attention-dropout 0)
TRAINING_ARGS=(--micro-batch-size 8 --global-batch-size 256 --train-iters 57344 --lr 1e-3 --min-lr 1e-4
               --lr-decay-style cosine --lr-warmup-iters 1024 --weight-decay 0.01 --adam-beta2 0.95
               --clip-grad 1.0)
DATA_ARGS=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
           --data-path "$DATA_PATH" --split 98,1,1)
OUTPUT_ARGS=(--save "$SAVE" --load "$SAVE" --save-interval 1000 --eval-interval 1000 --eval-iters 10
             --log-interval 10 --tensorboard-dir "$SAVE/tensorboard")

torchrun --nproc-per-node "$NPROC" -m fe_megatron.megatron_lm.pretrain_gpt $FE_MEMORY_ARGS \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" $DEVICE_ARGS "$@"
