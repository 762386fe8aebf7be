"""DeepSpeed adapter: fe-pretrain's ``training.engine: deepspeed`` (`engine`), the JSON config
checked against the training config (`config`), and row-sharded tables kept outside ZeRO
(`tables`).  A thin layer over `fe_megatron.hf` and `fe_megatron.memory`; docs/deepspeed.md."""
