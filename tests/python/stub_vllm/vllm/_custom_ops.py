"""STUB vllm._custom_ops: indexer_k_quant_and_cache (pinned parameters; stores K unquantized
here), and the _C::top_k_per_row_decode op the pinned indexer calls as torch.ops._C.*."""
import torch

DENSE_DECODE_CALLS = [0]


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype):
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat[slot_mapping.long()] = k.to(flat.dtype)


def _top_k_per_row_decode(logits, next_n, seq_lens, topk, num_rows, stride0, stride1, k):
    """Row i's top-k among columns [0, seq_lens.flatten()[i]), ties to the lower column; the
    rest of the row -1 (what the pinned indexer expects of its top-K kernels)."""
    lens = seq_lens.reshape(-1)
    for i in range(num_rows):
        n = int(lens[i]) if i < lens.numel() else 0
        topk[i].fill_(-1)
        if n <= 0:
            continue
        row = logits[i, :n]
        order = sorted(range(n), key=lambda c: (-float(row[c]), c))[: min(k, n)]
        topk[i, : len(order)] = torch.tensor(order, dtype=topk.dtype)


_lib = torch.library.Library("_C", "DEF")
_lib.define("top_k_per_row_decode(Tensor logits, int next_n, Tensor seq_lens, Tensor(a!) topk, "
            "int num_rows, int stride0, int stride1, int topk_tokens) -> ()")
_lib.impl("top_k_per_row_decode", _top_k_per_row_decode, "CPU")
