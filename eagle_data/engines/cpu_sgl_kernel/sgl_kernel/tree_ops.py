"""Draft-tree ops of the stand-in ``sgl_kernel``: build the verify tree, verify it greedily.

Semantics follow sgl-kernel's CPU kernels (``csrc/cpu/spec.cpp``) and the Triton versions in
``sglang/kernels/ops/speculative/spec_tree.py`` (0.5.23). A tree has ``n = draft_token_num`` nodes per
request; node 0 is the verified (bonus) token, node ``i >= 1`` is draft ``selected_index[i - 1]``.
"""

from __future__ import annotations

import torch

#: ``sglang...spec_tree.TreeMaskMode``: the mask holds the prefix columns too / only [n, n] per request
FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2


def _parent_positions(parents: list[int], sel: list[int], topk: int, n: int) -> list[int]:
    """Node index of each node's parent (-1: not found, node skipped); node 0 is the root."""
    out = [0] * n
    for i in range(1, n):
        tb = sel[i - 1] // topk
        if tb == 0:
            continue
        try:
            out[i] = sel.index(parents[tb]) + 1
        except ValueError:
            out[i] = -1
    return out


def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                                    positions: torch.Tensor, retrive_index: torch.Tensor,
                                    retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                                    topk: int, depth: int, draft_token_num: int, tree_mask_mode: int) -> None:
    """Fill the tree of each request ``b`` (all outputs in place).

    Args:
        parent_list: [bs, topk * (depth - 1) + 1]; selected_index: [bs, n - 1]; verified_seq_len: [bs]
            committed length ``L_b``.
        tree_mask: bool; QLEN_ONLY: [bs * n * n] (row ``i`` of request ``b``: which nodes node ``i``
            sees); FULL_MASK: per request [n, L_b + n] rows, requests concatenated (prefix columns are
            left as the caller filled them).
        positions: [bs * n] ``L_b`` + depth of the node; retrive_index: [bs, n] flat node index
            ``b * n + i``; retrive_next_token / retrive_next_sibling: [bs, n], pre-filled with -1:
            first child / next sibling (children linked most recent first, as the kernel does).
    """
    if int(tree_mask_mode) == QLEN_ONLY_BITPACKING:
        raise RuntimeError("build_tree_kernel_efficient_cpu: QLEN_ONLY_BITPACKING is not supported on CPU")
    n, topk = int(draft_token_num), int(topk)
    lens = [int(x) for x in verified_seq_len.tolist()]
    flat_pos = positions.view(-1)
    mask_off = 0
    for b, L in enumerate(lens):
        sel = [int(x) for x in selected_index[b].tolist()]
        parent = _parent_positions([int(x) for x in parent_list[b].tolist()], sel, topk, n)
        retrive_index[b] = torch.arange(b * n, (b + 1) * n, dtype=retrive_index.dtype)
        for i in range(n - 1, 0, -1):
            p = parent[i]
            if p < 0:
                continue
            head = int(retrive_next_token[b, p])
            retrive_next_token[b, p] = i
            if head != -1:
                retrive_next_sibling[b, i] = head
        width = n if int(tree_mask_mode) == QLEN_ONLY else L + n
        start = b * n * n if int(tree_mask_mode) == QLEN_ONLY else mask_off
        col0 = 0 if int(tree_mask_mode) == QLEN_ONLY else L
        rows = tree_mask[start:start + n * width].view(n, width)
        flat_pos[b * n] = L
        for i in range(n):
            rows[i, col0:col0 + n] = False
            rows[i, col0] = True
            if i == 0:
                continue
            d, cur = 0, i
            while cur > 0:  # node i and its ancestors up to the root (column 0)
                d += 1
                rows[i, col0 + cur] = True
                cur = parent[cur]
            flat_pos[b * n + i] = L + d
        mask_off += n * (L + n)


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                           candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Accept, per request, the longest root path whose drafts equal the target's argmax.

    Args:
        predicts: [bs * n] int32, out: the target's token at each accepted node and after the last one.
        accept_index: [bs, S] int32, out: flat node indices of the accepted path (root first), -1 padded
            by the caller; accept_token_num: [bs] int32, out: accepted drafts (root/bonus excluded).
        candidates, retrive_*, target_predict: [bs, n] (same integer dtype).
    """
    for t, name in ((predicts, "predicts"), (accept_index, "accept_index"), (accept_token_num, "accept_token_num")):
        if t.dtype != torch.int32:
            raise RuntimeError(f"verify_tree_greedy_cpu: {name} must be int32, got {t.dtype}")
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    target = target_predict.reshape(-1).tolist()
    for b in range(bs):
        ri = retrive_index[b].tolist()
        nxt = retrive_next_token[b].tolist()
        sib = retrive_next_sibling[b].tolist()
        cand = candidates[b].tolist()
        last = ri[0]
        accept_index[b, 0] = last
        correct, cur = 0, 0
        for _ in range(1, steps):
            cur = nxt[cur]
            while cur != -1:
                if cand[cur] == target[last]:
                    predicts[last] = target[last]
                    correct += 1
                    accept_index[b, correct] = ri[cur]
                    last = ri[cur]
                    break
                cur = sib[cur]
            if cur == -1:
                break
        accept_token_num[b] = correct
        predicts[last] = target[last]
