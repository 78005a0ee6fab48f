"""TorchAttentionBackend against a naive reference: per-sequence causal softmax attention over plain
contiguous K/V, on random varlen batches of decodes and prefill chunks over random paged block tables."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ops.attention.backend import AttentionMetadata, kv_rows, store_kv
from ops.attention.torch_backend import TorchAttentionBackend
from ops.cpu import load_cpu_kernels, missing_toolchain

HEAD_DIM = 16
HEAD_PAIRS = [(4, 4), (8, 2), (6, 1), (4, 2)]  # (num_heads, num_kv_heads): MHA, GQA, MQA


@pytest.fixture(params=[True, False], ids=["cpu-kernel", "pure-torch"])
def use_cpu_kernel(request) -> bool:
    """Decodes through the compiled CPU kernel, or through the gather + SDPA fallback."""
    if request.param:
        _skip_without_toolchain()
    return request.param


def _skip_without_toolchain() -> None:
    # Only where nothing can compile: with a toolchain, a kernel that fails to build fails the test.
    if missing_toolchain():
        pytest.skip(f"CPU kernels not compiled: {missing_toolchain()}")


@dataclass
class Seq:
    context_len: int  # tokens already in the cache before this step
    query_len: int  # tokens computed this step
    k: torch.Tensor  # [context_len + query_len, num_kv_heads, head_dim], the whole sequence
    v: torch.Tensor
    q: torch.Tensor  # [query_len, num_heads, head_dim]
    block_ids: list[int]

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


def make_batch(
    shapes: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    num_blocks: int,
    gen: torch.Generator,
) -> list[Seq]:
    """One Seq per (context_len, query_len), with distinct random blocks from 1..num_blocks-1."""
    need = [-(-(c + q) // block_size) for c, q in shapes]
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    assert sum(need) <= len(pool), "test batch does not fit the cache"
    seqs = []
    for (context_len, query_len), n in zip(shapes, need):
        total = context_len + query_len
        seqs.append(
            Seq(
                context_len,
                query_len,
                k=torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen),
                v=torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen),
                q=torch.randn(query_len, num_heads, HEAD_DIM, generator=gen),
                block_ids=[pool.pop() for _ in range(n)],
            )
        )
    return seqs


def slot(seq: Seq, position: int, block_size: int) -> int:
    return seq.block_ids[position // block_size] * block_size + position % block_size


def build_metadata(seqs: list[Seq], block_size: int, extra_table_columns: int = 0) -> AttentionMetadata:
    query_lens = [s.query_len for s in seqs]
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    width = max(len(s.block_ids) for s in seqs) + extra_table_columns
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)  # padded with the null block 0
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
    slots = [slot(s, p, block_size) for s in seqs for p in range(s.context_len, s.seq_len)]
    return AttentionMetadata(
        num_tokens=query_start_loc[-1],
        num_decodes=next((i for i, n in enumerate(query_lens) if n != 1), len(seqs)),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=[s.seq_len for s in seqs],
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor([s.seq_len for s in seqs], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )


def block_and_offset(seq: Seq, start: int, end: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where positions start..end-1 of `seq` live: their block ids and offsets in those blocks."""
    positions = torch.arange(start, end)
    return torch.tensor(seq.block_ids)[positions // block_size], positions % block_size


def write_context(kv_cache: torch.Tensor, seqs: list[Seq], block_size: int) -> None:
    """Put each sequence's cached context where the layout [blocks, 2, block_size, kv_heads, dim] wants it."""
    for s in seqs:
        blocks, offsets = block_and_offset(s, 0, s.context_len, block_size)
        kv_cache[blocks, 0, offsets] = s.k[: s.context_len]
        kv_cache[blocks, 1, offsets] = s.v[: s.context_len]


def reference(seq: Seq, num_heads: int, num_kv_heads: int, window: int | None = None,
              scale: float = HEAD_DIM**-0.5, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain causal softmax attention of the step's queries over the whole sequence (or the last `window`
    positions of it), in float64."""
    group = num_heads // num_kv_heads
    q = seq.q.double().transpose(0, 1)  # [heads, q_len, dim]
    k = seq.k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq_len, dim]
    v = seq.v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale
    query_pos = torch.arange(seq.context_len, seq.seq_len)[:, None]
    visible = torch.arange(seq.seq_len)[None, :] <= query_pos
    if window is not None:
        visible &= torch.arange(seq.seq_len)[None, :] > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # gpt-oss: each head's sink logit joins the softmax, with no value
        sink = sinks.double().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        return (torch.cat([scores, sink], -1).softmax(-1)[..., :-1] @ v).transpose(0, 1).float()
    return (scores.softmax(-1) @ v).transpose(0, 1).float()  # [q_len, heads, dim]


def fused_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v as the model passes them: strided views into one fused qkv projection."""
    n, d = q.shape[0], q.shape[-1]
    qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
    parts = qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=-1)
    return tuple(p.view(n, -1, d) for p in parts)


def run_step(
    shapes: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    seed: int,
    use_cpu_kernel: bool,
    fused_qkv: bool = False,
    window: int | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Twice the blocks the batch needs, so that the block ids are scattered over the cache.
    num_blocks = 2 * sum(-(-(c + q) // block_size) for c, q in shapes) + 4
    seqs = make_batch(shapes, num_heads, num_kv_heads, block_size, num_blocks, gen)
    backend = TorchAttentionBackend(
        num_heads, num_kv_heads, HEAD_DIM, block_size, num_blocks, torch.float32, torch.device("cpu"),
        scale=scale, sliding_windows=(window,) if window else (), use_cpu_kernel=use_cpu_kernel,
    )
    assert (backend._cpu_kernels is not None) == use_cpu_kernel, "the CPU kernel failed to build"
    # Finite garbage everywhere else: padded and masked slots must not leak into the output.
    kv_cache = torch.randn(backend.kv_cache_shape(), generator=gen)
    write_context(kv_cache, seqs, block_size)
    before = kv_cache.clone()

    backend.plan(build_metadata(seqs, block_size, extra_table_columns=1))
    q = torch.cat([s.q for s in seqs])
    k = torch.cat([s.k[s.context_len :] for s in seqs])
    v = torch.cat([s.v[s.context_len :] for s in seqs])
    if fused_qkv:
        q, k, v = fused_views(q, k, v)
        assert not k.is_contiguous()
    out = backend.forward(q, k, v, kv_cache, window, sinks)

    assert out.shape == q.shape and out.dtype == torch.float32
    expected = torch.cat([reference(s, num_heads, num_kv_heads, window, scale or HEAD_DIM**-0.5, sinks)
                          for s in seqs])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    # This step's K/V landed in their slots, and nothing else in the cache moved.
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for s in seqs:
        blocks, offsets = block_and_offset(s, s.context_len, s.seq_len, block_size)
        written[blocks, offsets] = True
        assert torch.equal(kv_cache[blocks, 0, offsets], s.k[s.context_len :])
        assert torch.equal(kv_cache[blocks, 1, offsets], s.v[s.context_len :])
    assert torch.equal(kv_cache.transpose(1, 2)[~written], before.transpose(1, 2)[~written])


def random_shapes(gen: torch.Generator, num_decodes: int, num_prefills: int, max_len: int) -> list[tuple[int, int]]:
    """Decodes first (query_len 1 over some context), then prefill chunks, half with cached context."""
    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    decodes = [(randint(0, max_len), 1) for _ in range(num_decodes)]
    prefills = [(randint(0, max_len) if i % 2 else 0, randint(2, max_len)) for i in range(num_prefills)]
    return decodes + prefills


@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_PAIRS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("seed", range(3))
def test_mixed_batch_matches_reference(
    num_heads: int, num_kv_heads: int, block_size: int, seed: int, use_cpu_kernel: bool
) -> None:
    gen = torch.Generator().manual_seed(1000 + seed)
    shapes = random_shapes(gen, num_decodes=4, num_prefills=4, max_len=70)
    run_step(shapes, num_heads, num_kv_heads, block_size, seed, use_cpu_kernel)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)])
def test_strided_qkv_from_a_fused_projection(num_heads: int, num_kv_heads: int, use_cpu_kernel: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    shapes = random_shapes(gen, num_decodes=3, num_prefills=3, max_len=40)
    run_step(shapes, num_heads, num_kv_heads, 16, 5, use_cpu_kernel, fused_qkv=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [9, 600])  # 600: enough bytes that the copy runs on both threads
def test_the_kernel_stores_kv_where_index_copy_does(dtype: torch.dtype, tokens: int) -> None:
    _skip_without_toolchain()
    gen = torch.Generator().manual_seed(tokens)
    num_blocks, block_size, kv_heads, d = 160, 4, 2, HEAD_DIM
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * d, generator=gen).to(dtype)  # 4 query heads, then K's, V's
    k = qkv[:, 4 * d : (4 + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (4 + kv_heads) * d :].view(tokens, kv_heads, d)
    k_rows, v_rows = kv_rows(torch.randperm(num_blocks * block_size, generator=gen)[:tokens], block_size)
    expected = torch.randn(num_blocks, 2, block_size, kv_heads, d, generator=gen).to(dtype)
    cache = expected.clone()
    store_kv(expected, k, v, k_rows, v_rows)
    load_cpu_kernels().store_kv(cache, k, v, k_rows)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match=r"k_rows\[0\] = \d+ is not a K row of the cache"):
        load_cpu_kernels().store_kv(cache, k, v, v_rows)  # V's rows: each would overwrite the next block's K


@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_PAIRS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(
    "shapes",
    [
        [(5, 1)],  # a single decode
        [(0, 1), (16, 1), (17, 1), (31, 1)],  # decodes only, including a first token and block edges
        [(0, 7)],  # a single prompt, no context
        [(0, 16), (0, 3), (0, 33)],  # prefills only
        [(16, 16), (15, 2), (1, 30)],  # chunks after cached context, at and off block edges
        [(9, 1), (0, 1)],  # decode batch with an unequal context
        [(3, 1), (0, 20), (12, 5), (0, 2)],  # everything at once
        [(0, 5), (7, 1)],  # a single-token chunk after a prefill runs the prefill path
    ],
    ids=["one-decode", "decodes", "one-prompt", "prompts", "chunks", "uneven-decodes", "mixed", "late-decode"],
)
def test_edge_shapes_match_reference(
    num_heads: int, num_kv_heads: int, block_size: int, shapes: list[tuple[int, int]], use_cpu_kernel: bool
) -> None:
    run_step(shapes, num_heads, num_kv_heads, block_size, 7, use_cpu_kernel)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)])
def test_sliding_window_matches_reference(
    num_heads: int, num_kv_heads: int, block_size: int, window: int, use_cpu_kernel: bool
) -> None:
    """Decodes and chunks whose context is shorter and longer than the window, at and off block edges, with a
    scale that is not head_dim's (Gemma's query_pre_attn_scalar)."""
    shapes = [(0, 1), (window - 1, 1), (window, 1), (3 * window + 5, 1), (0, 2 * window + 3), (window + 7, 9),
              (2 * window, window), (1, 3)]
    run_step(shapes, num_heads, num_kv_heads, block_size, 11, use_cpu_kernel, window=window, scale=0.3)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)])
def test_attention_sinks_match_reference(num_heads: int, num_kv_heads: int, window: int | None,
                                         use_cpu_kernel: bool) -> None:
    """gpt-oss's sinks, large and small against the scores, with and without a window and cached context."""
    sinks = torch.linspace(-3.0, 4.0, num_heads)
    shapes = [(0, 1), (7, 1), (30, 1), (0, 12), (9, 6), (20, 1), (1, 3)]
    run_step(shapes, num_heads, num_kv_heads, 4, 13, use_cpu_kernel, window=window, sinks=sinks)


def test_two_steps_read_what_the_first_wrote() -> None:
    """A prompt chunk then a decode, the second reading K/V written by the backend itself."""
    num_heads, num_kv_heads, block_size = 8, 2, 16
    gen = torch.Generator().manual_seed(3)
    (seq,) = make_batch([(0, 21)], num_heads, num_kv_heads, block_size, 8, gen)
    backend = TorchAttentionBackend(
        num_heads, num_kv_heads, HEAD_DIM, block_size, 8, torch.float32, torch.device("cpu")
    )
    kv_cache = torch.zeros(backend.kv_cache_shape())
    first = Seq(0, 20, seq.k[:20], seq.v[:20], torch.randn(20, num_heads, HEAD_DIM, generator=gen), seq.block_ids)
    backend.plan(build_metadata([first], block_size))
    out = backend.forward(first.q, first.k, first.v, kv_cache)
    torch.testing.assert_close(out, reference(first, num_heads, num_kv_heads), atol=1e-5, rtol=1e-5)

    second = Seq(20, 1, seq.k, seq.v, seq.q[20:], seq.block_ids)
    backend.plan(build_metadata([second], block_size))
    out = backend.forward(second.q, seq.k[20:], seq.v[20:], kv_cache)
    torch.testing.assert_close(out, reference(second, num_heads, num_kv_heads), atol=1e-5, rtol=1e-5)


def test_rejects_heads_that_do_not_group() -> None:
    with pytest.raises(ValueError):
        TorchAttentionBackend(6, 4, HEAD_DIM, 16, 8, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_head_dims_and_dtypes_match_the_torch_path(head_dim: int, dtype: torch.dtype) -> None:
    """The kernel's compile-time head_dim specialisations (64, 128) and generic path agree with the
    gather + SDPA path on decodes over a shared, scattered cache."""
    _skip_without_toolchain()
    num_heads, num_kv_heads, block_size, num_blocks = 8, 2, 16, 64
    gen = torch.Generator().manual_seed(head_dim)
    args = (num_heads, num_kv_heads, head_dim, block_size, num_blocks, dtype, torch.device("cpu"))
    kernel, fallback = TorchAttentionBackend(*args), TorchAttentionBackend(*args, use_cpu_kernel=False)
    assert kernel._cpu_kernels is not None
    cache = torch.randn(kernel.kv_cache_shape(), generator=gen).to(dtype)
    seq_lens = [1, 17, 64, 200, 33]
    tables = torch.zeros(len(seq_lens), 13, dtype=torch.int32)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    for i, n in enumerate(seq_lens):
        tables[i, : -(-n // block_size)] = torch.tensor([ids.pop() for _ in range(-(-n // block_size))])
    slots = torch.tensor([int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for i, n in enumerate(seq_lens)])
    md = AttentionMetadata(
        len(seq_lens), len(seq_lens), list(range(len(seq_lens) + 1)), seq_lens,
        torch.arange(len(seq_lens) + 1, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), tables, slots,
    )
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(len(seq_lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(seq_lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    outs = []
    for backend in (kernel, fallback):
        backend.plan(md)
        outs.append(backend.forward(q, k, v, cache.clone()))
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)
