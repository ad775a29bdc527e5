"""Triton kernels: paged attention for decodes and prefill chunks over a cached prefix.

One kernel serves both. A program owns (work, KV head, tile of query tokens); its rows are
the tile's tokens times the G query heads sharing that KV head (padded to G_PAD), so every
key is loaded once for the whole group (GQA)::

    row r  ->  token  tile * TOKENS + r // G_PAD,   query head  kv_head * G + r % G_PAD

It walks the keys of its sequence through the block table (BLOCK_N positions per step, each
position's block looked up, so any power-of-two block size works), with an online softmax;
a query at position p sees keys max(0, p - W + 1) .. p (W = 0: no window). The step's own
K/V are already in the pool (written before the call), so cached and fresh keys are read
the same way.

Decode-only steps with few programs split each context into NUM_SPLITS parts
(flash-decoding): partial (max, sum, acc) go to scratch and `_combine_splits` merges them.
Shapes depend only on the batch size and the split count, so a decode step can be captured
in a CUDA graph.

Runs on CUDA, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), which
is how CI checks it against the reference backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per program: tl.dot needs at least 16
BLOCK_N = 32  # key positions per step


@triton.jit
def _paged_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    m_part_ptr,
    l_part_ptr,
    acc_part_ptr,
    query_start_ptr,
    query_len_ptr,
    context_len_ptr,
    block_tables_ptr,
    stride_table,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_ot,
    stride_oh,
    scale,
    window,
    num_heads,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    TOKENS: tl.constexpr = BLOCK_M // G_PAD

    q_len = tl.load(query_len_ptr + work)
    ctx = tl.load(context_len_ptr + work)
    q_first = tl.load(query_start_ptr + work)
    tok0 = tile * TOKENS
    if tok0 < q_len:
        rows = tl.arange(0, BLOCK_M)
        tok = tok0 + rows // G_PAD
        g = rows % G_PAD
        row_ok = (tok < q_len) & (g < G)
        pos = ctx - q_len + tok
        head = kv_head * G + g
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q_rows = (q_first + tok).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)

        last_tok = tl.minimum(tok0 + TOKENS, q_len) - 1
        hi = ctx - q_len + last_tok + 1
        lo = tl.where(window > 0, tl.maximum(ctx - q_len + tok0 - window + 1, 0), 0)
        per_split = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * per_split
        end = tl.minimum(start + per_split, hi)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        table = block_tables_ptr + work.to(tl.int64) * stride_table
        for n0 in range(start, end, BLOCK_N):
            kpos = n0 + tl.arange(0, BLOCK_N)
            k_ok = kpos < end
            block = tl.load(table + kpos // PAGE, mask=k_ok, other=0).to(tl.int64)
            slot = block * stride_kb + (kpos % PAGE) * stride_ko + kv_head * stride_kh
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            visible = k_ok[None, :] & (kpos[None, :] <= pos[:, None])
            visible = visible & ((window <= 0) | (kpos[None, :] > pos[:, None] - window))
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )
        else:
            part = (q_rows * num_heads + head) * NUM_SPLITS + split
            tl.store(m_part_ptr + part, m_i, mask=row_ok)
            tl.store(l_part_ptr + part, l_i, mask=row_ok)
            tl.store(
                acc_part_ptr + part[:, None] * D_PAD + d[None, :],
                acc,
                mask=row_ok[:, None] & d_ok[None, :],
            )


@triton.jit
def _combine_splits(
    m_part_ptr,
    l_part_ptr,
    acc_part_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_PAD)
    base = (token * num_heads + head) * NUM_SPLITS
    m = tl.load(m_part_ptr + base + s)
    l = tl.load(l_part_ptr + base + s)  # noqa: E741 - the softmax denominator
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
    total = tl.sum(l * weight, 0)
    acc = tl.load(acc_part_ptr + (base + s)[:, None] * D_PAD + d[None, :])
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start: torch.Tensor,
    query_len: torch.Tensor,
    context_len: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    window: int | None,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D], pools [num_blocks, B, H_kv, D] (step's K/V written) -> out [T, H, D].

    ``num_splits`` > 1 (decode-only steps, ``max_query_len`` 1) splits each context.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    g_pad = _pow2(group)
    block_m = max(BLOCK_M, g_pad)
    tokens_per_tile = block_m // g_pad
    d_pad = max(16, _pow2(head_dim))
    if num_splits > 1 and max_query_len != 1:
        raise ValueError("split-KV is for decode-only steps (one query per work)")
    num_splits = _pow2(num_splits)
    out = torch.empty_like(q) if out is None else out
    num_works = int(query_start.shape[0])
    if num_works == 0:
        return out
    if num_splits > 1:
        m_part = torch.empty(num_tokens * num_heads * num_splits, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(m_part.shape[0] * d_pad, device=q.device)
    else:
        m_part = l_part = acc_part = out  # unused
    tiles = triton.cdiv(max_query_len, tokens_per_tile)
    # Triton's interpreter (CPU tensors) mis-computes half-precision dots: upcast there.
    upcast = not q.is_cuda
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    _paged_attention[(num_works, num_kv_heads, tiles * num_splits)](
        q,
        key_cache,
        value_cache,
        out,
        m_part,
        l_part,
        acc_part,
        query_start,
        query_len,
        context_len,
        block_tables,
        block_tables.stride(0),
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        out.stride(0),
        out.stride(1),
        head_dim**-0.5,
        window or 0,
        num_heads,
        G=group,
        G_PAD=g_pad,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        PAGE=page,
        NUM_SPLITS=num_splits,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        PRECISION=precision,
        UPCAST=upcast,
    )
    if num_splits > 1:
        _combine_splits[(num_tokens, num_heads)](
            m_part,
            l_part,
            acc_part,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=num_splits,
        )
    return out
