#!/usr/bin/env bash
# fe-pretrain under torchrun: one node, or several nodes meeting at a rendezvous endpoint.
#
#   One node, one worker per visible GPU (or NPROC_PER_NODE workers on CPU):
#       launch_scripts/torchrun.sh --config CONFIG.yaml --save runs/x --load runs/x [section.key=value ...]
#   Several nodes: run the same command on every node, with the same endpoint (any one node's
#   address and a free port) and the same id:
#       NNODES=4 RDZV_ENDPOINT=node001:29500 RDZV_ID=run42 launch_scripts/torchrun.sh --config ...
#
# Every argument goes to fe-pretrain.  Variables:
#   NPROC_PER_NODE  workers on this node (default: the GPUs nvidia-smi lists, else 1)
#   NNODES          nodes in the job (default 1)
#   RDZV_ENDPOINT   host:port of the rendezvous, needed when NNODES > 1
#   RDZV_ID         a name shared by the job's nodes (default fe-pretrain)
#   RDZV_JOIN_TIMEOUT  seconds the rendezvous waits for all NNODES nodes, at the start and after
#                   a restart (default 600, torch's); a node that never comes back ends the launch
#                   after this long.  Under SLURM keep it above SlurmdTimeout, so that SLURM notices
#                   a dead node first and requeues the job (docs/operations.md, "Many nodes")
#   MAX_RESTARTS    how often torchrun restarts the workers after a failure (default 0); each
#                   restart resumes from the last checkpoint when --load is given
#   PYTHON          the interpreter with fe_megatron installed (default: the repository's
#                   .venv/bin/python when it exists, else python3)
#   OMP_NUM_THREADS CPU threads per worker (default: this node's CPUs / NPROC_PER_NODE)
#
# Network settings for NCCL on GPU clusters (set them before calling this script):
#   NCCL_SOCKET_IFNAME=ib0|eth0  the interface for NCCL's bootstrap and socket transport
#   GLOO_SOCKET_IFNAME=...       the same for gloo (CPU runs); without it gloo advertises the address
#                                the host name resolves to (a job across hosts refuses a loopback one)
#   NCCL_IB_HCA=mlx5             the InfiniBand adapters to use; NCCL_IB_DISABLE=1 without IB
#   NCCL_DEBUG=WARN              INFO prints the chosen transports once, when a job hangs at start
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1  a rank whose collective fails or times out exits, so that
#                                torchrun (MAX_RESTARTS) or SLURM (requeue) can take over
#   CUDA_DEVICE_MAX_CONNECTIONS=1      needed by Megatron when tensor parallelism overlaps
#                                communication with computation
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi

if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "$NPROC_PER_NODE" -gt 0 ] || NPROC_PER_NODE=1
fi
NNODES=${NNODES:-1}
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    cpus=${SLURM_CPUS_ON_NODE:-$(nproc)}
    export OMP_NUM_THREADS=$(( cpus / NPROC_PER_NODE > 0 ? cpus / NPROC_PER_NODE : 1 ))
fi

if [ "$NNODES" -eq 1 ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
    rendezvous=(--standalone)
elif [ -z "${RDZV_ENDPOINT:-}" ]; then
    echo "torchrun.sh: NNODES=$NNODES needs RDZV_ENDPOINT=host:port (any node's address, the same on all nodes)" >&2
    exit 2
else
    rendezvous=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"
                --rdzv-id="${RDZV_ID:-fe-pretrain}" --rdzv-conf="join_timeout=${RDZV_JOIN_TIMEOUT:-600}")
fi

# The configuration is checked once, in this process, before any worker starts: an error is one
# message (naming the file line or the override), not one per rank under a launcher traceback.
"$PYTHON" -m fe_megatron.train --check "$@" > /dev/null || exit 2

# A fresh store for every attempt, hosted by its rank 0.  Otherwise torchrun's agents keep one store
# across restarts, and the workers keep attempts apart by the restart count; but a node whose own
# workers were healthy restarts them without counting when another node's worker failed, so the
# nodes' counts differ and their restarted workers look for each other under different keys.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# SIGUSR1 asks the workers to save after the current step and stop (SLURM sends it before a
# time limit or a preemption, to every process of the job step).  torchrun itself would die of
# it, so it ignores it; the workers inherit that and install their own handler.
trap '' USR1
exec "$PYTHON" -m torch.distributed.run "${rendezvous[@]}" --nproc-per-node="$NPROC_PER_NODE" \
    --max-restarts="${MAX_RESTARTS:-0}" -m fe_megatron.train "$@"
