#!/bin/bash
# An ordinary Megatron-LM GPT pretraining launch (one node): pretrain_gpt.py from a Megatron-LM
# checkout. pretrain_gpt_factorengram.sh is this script with the launch line changed.
set -euo pipefail

NPROC=${NPROC:-8}
DATA_PATH=${DATA_PATH:?set DATA_PATH to the --data-path prefix (fe-data preprocess or preprocess_data.py)}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a SentencePiece .model file}
SAVE=${SAVE:-checkpoints/gpt}
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

torchrun --nproc-per-node "$NPROC" "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout}/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" $DEVICE_ARGS "$@"
