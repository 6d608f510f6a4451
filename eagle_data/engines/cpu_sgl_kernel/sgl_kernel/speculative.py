"""``sgl_kernel.speculative`` stand-in: what SGLang's NGRAM speculative decoding imports on the CPU path."""

from __future__ import annotations

import torch


def reconstruct_indices_from_tree_mask(tree_mask: torch.Tensor, verified_seq_len: torch.Tensor,
                                       positions: torch.Tensor, retrieve_index: torch.Tensor,
                                       retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                                       batch_size: int, draft_token_num: int) -> None:
    """The verify metadata of ``batch_size`` draft trees of ``n = draft_token_num`` nodes, in place
    (the contract written out in sglang's ``kernels/ops/speculative/reconstruct_tree.py``):
    ``tree_mask`` [B*n*n] bool, ``[b, i, j]`` = node j is an ancestor of node i (or i itself);
    ``positions`` [B*n] = strict ancestors of the node + ``verified_seq_len[b]``;
    ``retrieve_index`` [B, n] = ``b * n + i``; ``retrieve_next_token`` = the node's first child
    (smallest k > i it is an ancestor of), else -1; ``retrieve_next_sibling`` = the next node
    k > i with the same parent, else -1 (-1 for the root)."""
    b, n = int(batch_size), int(draft_token_num)
    m = tree_mask.reshape(b, n, n).bool()
    anc = m & torch.ones(n, n, dtype=torch.bool, device=m.device).tril(-1)  # [b, i, j]: j < i ancestors of i
    positions.view(b, n).copy_(anc.sum(-1) + verified_seq_len.view(b, 1).to(positions.dtype))
    retrieve_index.view(b, n).copy_(torch.arange(b * n, device=m.device).view(b, n))
    idx = torch.arange(n, device=m.device)
    parent = torch.where(anc.any(-1), (anc * idx).amax(-1), -1)  # [b, i]: the nearest ancestor
    child = anc.transpose(1, 2) & (idx.view(1, 1, n) > idx.view(1, n, 1))  # [b, i, k]: i is an ancestor of k > i
    direct = child & (parent.unsqueeze(1) == idx.view(1, n, 1))  # k's parent is i
    big = torch.full_like(parent, n)
    first_child = torch.where(direct.any(-1), torch.where(direct, idx.view(1, 1, n), n).amin(-1), big)
    same = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (idx.view(1, 1, n) > idx.view(1, n, 1))  # [b, i, k]
    sibling = torch.where(same.any(-1), torch.where(same, idx.view(1, 1, n), n).amin(-1), big)
    sibling = torch.where(parent < 0, big, sibling)
    retrieve_next_token.view(b, n).copy_(torch.where(first_child >= n, -1, first_child))
    retrieve_next_sibling.view(b, n).copy_(torch.where(sibling >= n, -1, sibling))
