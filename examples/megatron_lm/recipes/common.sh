# What every recipe here reads from the environment (sourced by the recipe scripts).
#   DATA_PATH        the --data-path prefix (fe-data preprocess, or Megatron-LM's preprocess_data.py)
#   TOKENIZER_MODEL  the SentencePiece model the data was made with
#   SAVE             the run's checkpoint directory (--save and --load: a second launch resumes)
#   FE_ARGS          the memory's --fe-* arguments (default: the tiny preset on CPU, the 340M one on GPUs)
#   SIZE             cpu (default: the recipe shrunk for a 2-core machine, fp32, gloo) or full
#   NUM_LAYERS       at SIZE=full, the number of layers (default: the recipe's; a GPU check shortens only the stack)
#   NPROC, TP        processes per node and tensor-parallel size (default 1 and 1)
#   TRAIN_ITERS, SAVE_INTERVAL   the CPU size's steps and checkpoint interval (default 6 and 3); at
#                    SIZE=full, TRAIN_ITERS (unset by default) shortens Llama-3's run to that many steps
DATA_PATH=${DATA_PATH:?set DATA_PATH to the --data-path prefix (fe-data preprocess or preprocess_data.py)}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece model the data was made with}
SAVE=${SAVE:?set SAVE to the run directory (checkpoints, metrics.jsonl, TensorBoard)}
SIZE=${SIZE:-cpu}
NPROC=${NPROC:-1}
TP=${TP:-1}
if [ "$SIZE" = full ]; then TRAIN_ITERS=${TRAIN_ITERS:-}; else TRAIN_ITERS=${TRAIN_ITERS:-6}; fi
SAVE_INTERVAL=${SAVE_INTERVAL:-3}
if [ "$SIZE" = full ]; then
    FE_ARGS=${FE_ARGS:---fe-memory-preset factorengram-340m}
else
    FE_ARGS=${FE_ARGS:---fe-memory-preset factorengram-tiny --fe-memory-layers 1 3}
fi
# CPU: the device flags every CPU run of Megatron-LM needs (gloo; no fused CUDA kernels; weights made on the host)
CPU_DEVICE_ARGS="--transformer-impl local --distributed-backend gloo --use-cpu-initialization
    --no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion --no-bias-swiglu-fusion
    --no-rope-fusion"
