"""``fe-convert``: checkpoints between fe-pretrain's engines and Hugging Face, and grafts.

* `to_hf`: a Megatron run (`mcore-to-hf`) to a Hugging Face directory;
* `deepspeed_to_hf`: a DeepSpeed run (`deepspeed-to-hf`) to a Hugging Face directory;
* `to_mcore`: a Hugging Face directory to a Megatron run at any TP/PP (`hf-to-mcore`);
* `graft`: memory branches added to a pretrained Llama-like model (`graft`);
* `cli`: the command line.
"""

from fe_megatron.convert.common import ConversionError

__all__ = ["ConversionError"]
