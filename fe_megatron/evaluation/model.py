"""A trained model for evaluation: load it from a run directory or a transformers directory, and
score token sequences with it.

A run directory's checkpoint, of either engine (the Megatron engine's at any TP/PP/DP layout and
table sharding: its tensors are stored whole by global name; the DeepSpeed engine's consolidated from
ZeRO's partitions, its tables by global row in the format both engines write), is read tensor by
tensor into `fe_megatron.hf.FactorEngramForCausalLM`,
the same function as the Megatron model (tested to 1e-5 in ``tests/integration/test_hf_conversion.py``); no optimizer
is built.  The tokenizer is the run's, found through ``fe_run.json`` and checked by checksum.
"""

from __future__ import annotations

import os
from typing import Optional

import torch


class EvalModel:
    """``model`` (a transformers causal LM in eval mode), ``encode`` (text -> ids) and the longest
    sequence the model was built for (``max_length``)."""

    def __init__(self, model, encode, decode, max_length: int, source: str):
        self.model = model.eval()
        self.encode = encode
        self.decode = decode
        self.max_length = max_length
        self.source = source

    @classmethod
    def load(cls, path: str, iteration: Optional[int] = None, tokenizer: Optional[str] = None) -> "EvalModel":
        """From a run directory (fe-pretrain's ``--save``) or a transformers model directory."""
        if os.path.isfile(os.path.join(path, "config.json")):
            return cls._from_transformers(path)
        return cls._from_run(path, iteration, tokenizer)

    @classmethod
    def _from_transformers(cls, path: str) -> "EvalModel":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import fe_megatron.hf  # noqa: F401 - registers FactorEngramForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path)
        # fe-eval windows every text to the model's context itself: the whole text is encoded first,
        # which transformers would flag as longer than the model's maximum on every long document
        tok.model_max_length = int(1e30)
        return cls(model, lambda text: tok.encode(text, add_special_tokens=False), tok.decode,
                   model.config.max_position_embeddings, path)

    @classmethod
    def _from_run(cls, path: str, iteration: Optional[int], tokenizer: Optional[str]) -> "EvalModel":
        from fe_megatron.checkpoint.files import read_run_info
        from fe_megatron.checkpoint.reader import configs_of, find_checkpoint_folder, run_engine
        from fe_megatron.convert.common import run_tokenizer
        from fe_megatron.data.tokenizer import load_tokenizer
        from fe_megatron.hf import FactorEngramConfig, FactorEngramForCausalLM

        engine = run_engine(path)
        folder = find_checkpoint_folder(path, iteration, engine=engine)
        info = read_run_info(folder)
        backbone, memory = configs_of(info)
        try:
            config = FactorEngramConfig.from_fe_megatron(backbone, memory)
        except ValueError as error:
            raise ValueError(f"{folder}: {error}") from None
        tok = load_tokenizer(run_tokenizer(info, tokenizer))
        model = FactorEngramForCausalLM(config)
        params = model.state_dict()
        filled = set()
        with torch.no_grad():
            for hf_name, tensor in _run_weights(folder, info, backbone, memory, engine):
                if hf_name not in params:
                    raise ValueError(f"{folder} holds {hf_name}, which is no weight of the model its fe_run.json "
                                     "describes")
                params[hf_name].copy_(tensor)
                filled.add(hf_name)
        missing = sorted(set(params) - filled - ({"lm_head.weight"} if backbone.tie_embeddings else set()))
        if missing:
            raise ValueError(f"{folder} lacks weights {missing[:5]} of the model its fe_run.json describes")
        return cls(model, lambda text: [int(i) for i in tok.tokenize(text)], tok.detokenize, backbone.seq_length,
                   folder)

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def logprobs(self, ids: list) -> torch.Tensor:
        """``log p(ids[t] | ids[:t])`` for t = 1 .. len(ids) - 1 (fp64); ``len(ids) <= max_length``."""
        if len(ids) > self.max_length:
            raise ValueError(f"a sequence of {len(ids)} tokens is longer than the model's {self.max_length}")
        logits = self.model(torch.tensor([ids]), use_cache=False).logits[0, :-1].double()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)

    @torch.no_grad()
    def logprobs_batch(self, sequences: list, starts: list) -> list:
        """``[logprobs(ids)[start:] for ids, start in zip(sequences, starts)]`` in one forward pass.
        The sequences are padded on the right, which a causal model (attention and memory branches
        alike) never reads at the positions before the padding; only the logits from ``min(starts)``
        on are computed."""
        longest = max(len(ids) for ids in sequences)
        if longest > self.max_length:
            raise ValueError(f"a sequence of {longest} tokens is longer than the model's {self.max_length}")
        first = min(starts)
        batch = torch.tensor([ids + [0] * (longest - len(ids)) for ids in sequences])
        logits = self.model(batch, use_cache=False, logits_to_keep=longest - first).logits  # positions first..
        out = []
        for row, (ids, start) in enumerate(zip(sequences, starts)):
            kept = logits[row, start - first:len(ids) - 1 - first].double()
            out.append(torch.log_softmax(kept, -1).gather(1, torch.tensor(ids[start + 1:]).unsqueeze(1)).squeeze(1))
        return out

    @torch.no_grad()
    def continuation(self, context: list, continuation: list) -> tuple:
        """``(log-probabilities of the continuation's tokens, whether greedy decoding predicts every
        one of them)`` after ``context`` (the context is cut on the left to fit)."""
        ids = (context + continuation)[-self.max_length:]
        logits = self.model(torch.tensor([ids]), use_cache=False).logits[0, -len(continuation) - 1:-1].double()
        target = torch.tensor(continuation)
        logprobs = torch.log_softmax(logits, -1).gather(1, target.unsqueeze(1)).squeeze(1)
        return logprobs, bool((logits.argmax(-1) == target).all())

    @torch.no_grad()
    def greedy(self, ids: list, new_tokens: int) -> list:
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()


def _run_weights(folder: str, info: dict, backbone, memory, engine: str):
    """``(Hugging Face name, tensor)`` of every weight of checkpoint ``folder``, one at a time, read as
    ``fe-convert`` reads it: a Megatron-engine checkpoint through its reader
    (`fe_megatron.convert.megatron_reader.open_checkpoint`), a DeepSpeed one consolidated from ZeRO's
    partitions with its tables from the tables' checkpoint (`fe_megatron.convert.deepspeed_to_hf.
    DeepSpeedWeights`)."""
    if engine == "deepspeed":
        from fe_megatron.convert.deepspeed_to_hf import DeepSpeedWeights

        source = DeepSpeedWeights(folder, info, memory)
        for name in source.names():
            yield name, source.get(name)
        return
    from fe_megatron.convert.megatron_reader import open_checkpoint, split_checkpoint_tensor

    checkpoint = open_checkpoint(folder)
    for name in checkpoint.weight_names():
        yield from split_checkpoint_tensor(name, checkpoint.load(name), backbone)
