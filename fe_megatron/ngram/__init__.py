"""N-gram addressing: the multi-head hasher and optional token compression."""

from fe_megatron.ngram.compression import TokenCompression, load_token_compression, normalize_token_text
from fe_megatron.ngram.hashing import BranchLayout, NgramHasher, branch_layouts, validate_token_ids

__all__ = ["BranchLayout", "NgramHasher", "TokenCompression", "branch_layouts", "load_token_compression",
           "normalize_token_text", "validate_token_ids"]
