"""Logits of an fe-pretrain checkpoint's Megatron model at a given TP size, for comparison with the
converted Hugging Face model.  Usage (torchrun, TP = world size): RUN_DIR TOKENS.pt OUT.pt"""

import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region  # noqa: E402

from fe_megatron.checkpoint.files import read_run_info  # noqa: E402
from fe_megatron.checkpoint.reader import configs_of, find_checkpoint_folder  # noqa: E402
from fe_megatron.megatron.builder import build_gpt_model  # noqa: E402
from fe_megatron.megatron.parallel import initialize, shutdown  # noqa: E402
from fe_megatron.megatron.step import causal_mask  # noqa: E402
from fe_megatron.megatron.engine import transformer_config_for  # noqa: E402
from fe_megatron.training.config import ParallelArgs, TrainConfig  # noqa: E402


def main(run_dir: str, tokens_file: str, out_file: str) -> None:
    tp = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    folder = find_checkpoint_folder(run_dir)
    backbone, memory = configs_of(read_run_info(folder))
    cfg = TrainConfig(model=backbone, memory=memory, parallel=ParallelArgs(tensor=tp))
    initialize(tp, 1, seed=0)
    tconfig = transformer_config_for(cfg, on_gpu=False)
    model = build_gpt_model(tconfig, backbone.vocab_size, backbone.seq_length, memory,
                            share_embeddings=backbone.tie_embeddings, rotary_base=backbone.rope_base).eval()
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)["model"])
    tokens = torch.load(tokens_file)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions, causal_mask(tokens.shape[1]))  # [b, s, vocab / tp]
        logits = gather_from_tensor_model_parallel_region(logits)
    if dist.get_rank() == 0:
        torch.save(logits.contiguous(), out_file)
    dist.barrier()
    shutdown()  # Megatron's groups too, joined before Python exits (destroy_process_group alone leaves them)


if __name__ == "__main__":
    main(*sys.argv[1:4])
