"""STUB DeepGEMM entry points (pinned names and parameters), as float32 CPU references.

fp8_fp4_paged_mqa_logits: row (b, j) scores slot c < context_lens[b, j] of its paged cache as
sum_h weights[row, h] * relu(q[b, j, h] . K[c]) (DeepSeek's indexer score); columns at or past the
row's length hold 1e30 garbage, as an unclean kernel may leave there, so a caller that ignores
the lengths is caught.
"""
import torch

# The context lengths of every get_paged_mqa_logits_metadata call (tests check that the SPIN
# path builds its schedule from the compacted lengths).
SCHEDULE_CALLS = []


def get_paged_mqa_logits_metadata(context_lens, block_size, num_sms):
    SCHEDULE_CALLS.append(context_lens.clone())
    return torch.zeros((num_sms + 1, 2), dtype=torch.int32)


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables,
                             schedule_metadata, max_model_len, clean_logits):
    q_values, q_scale = q
    assert q_scale is None
    batch, next_n, heads, dim = q_values.shape
    block_size = kv_cache.shape[1]
    keys = kv_cache[:, :, 0, :].reshape(-1, dim)  # [pages * block_size, dim]
    cols = torch.arange(max_model_len)
    out = torch.full((batch * next_n, max_model_len), 1e30, dtype=torch.float32)
    for b in range(batch):
        nblk = block_tables.shape[1]
        page = block_tables[b, (cols // block_size).clamp(max=nblk - 1)].long().clamp(min=0)
        k = keys[page * block_size + cols % block_size]  # [W, dim]
        for j in range(next_n):
            row = b * next_n + j
            n = int(context_lens[b, j])
            s = torch.relu(q_values[b, j].float() @ k[:n].float().T)  # [heads, n]
            out[row, :n] = (weights[row].float()[:, None] * s).sum(0)
    return out
