"""The paged KV layout every attention kernel reads: a pool of fixed-size pages and a page table.

A cache stack is a pool [L, Hkv, N, Dh] of N = num_pages * page_size slots, shared by all rows. Row b's
logical slot s (its token position) lives in pool slot pages[b, s // page_size] * page_size +
s % page_size, where pages [B, R] is the page table (R pages a row, so R * page_size logical slots).
Page 0 is the null page: no request owns it, table entries a row does not use point at it, and the
kernels' writes to slots past a row's table land there (XLA scatters drop them: `scatter_slots`).
Nothing reads it unmasked, so its contents never matter (tests poison it); it only has to stay
finite, which every write keeps it.

NSA's compressed stacks [L, Hkv, N / block_size, Dh] use the same table: page p holds the compressed
entries of its page_size / block_size blocks.

Kernels stream a row's keys a block at a time; a block never straddles two pages (the page size is a
multiple of every key block), so each block starts at the `pool_slot` of its first slot; kernels that
gather slots or compressed entries one by one look each up with `pool_slot` too.
"""
import jax
import jax.numpy as jnp

NULL_PAGE = 0
PAGE_MULTIPLE = 64  # the attention kernels' key blocks (and NSA's compression blocks) divide this
DEFAULT_PAGE_SIZE = 128


def check_page_size(page_size: int, block_size: int | None = None) -> None:
    """A page size the kernels can tile: a positive multiple of PAGE_MULTIPLE (and of an NSA model's
    compression block)."""
    if page_size <= 0 or page_size % PAGE_MULTIPLE:
        raise ValueError(f"page size must be a positive multiple of {PAGE_MULTIPLE}, got {page_size}")
    if block_size is not None and page_size % block_size:
        raise ValueError(f"page size {page_size} must be a multiple of the NSA block size {block_size}")


def physical(pages: jax.Array, slots: jax.Array, page_size: int) -> jax.Array:
    """Pool slots of logical slots [B, ...] (row b's own slots); slots outside the table (negative, or
    past its last page) map into the null page."""
    R = pages.shape[1]
    page = slots // page_size
    rows = jnp.arange(pages.shape[0]).reshape((-1,) + (1,) * (slots.ndim - 1))
    inside = (slots >= 0) & (page < R)
    ids = jnp.where(inside, pages[rows, jnp.clip(page, 0, R - 1)], NULL_PAGE)
    return ids * page_size + slots % page_size


def scatter_slots(slots: jax.Array, page_size: int, size: int) -> jax.Array:
    """Pool `slots` for an XLA scatter with mode="drop": those in the null page become `size`, out of
    range, so their writes are dropped. Every padded position of a batch maps to the same null-page
    slot, and a GPU scatter serialises conflicting updates (a prefill of 256 rows padded to 2,047
    tokens: over 100 s against 7 s on an H200); the kernels write the null page instead."""
    return jnp.where(slots // page_size == NULL_PAGE, size, slots)


def layer_view(pool: jax.Array, layer, pages: jax.Array, page_size: int) -> jax.Array:
    """[B, Hkv, R * page_size, Dh]: layer `layer` of a pool [L, Hkv, N, Dh] as each row's contiguous
    slots (a gather of every page in the table: the references' and tests' view)."""
    return logical_view(jax.lax.dynamic_slice_in_dim(pool, layer, 1, 0), pages, page_size)[0]


def logical_view(pool: jax.Array, pages: jax.Array, page_size: int) -> jax.Array:
    """[L, B, Hkv, R * page_size, Dh]: every layer of a pool as contiguous rows (tests, checks)."""
    L, H, N, D = pool.shape
    B, R = pages.shape
    rows = pool.reshape(L, H, N // page_size, page_size, D)[:, :, pages]  # [L, Hkv, B, R, P, Dh]
    return jnp.moveaxis(rows.reshape(L, H, B, R * page_size, D), 2, 1)


def contiguous_pages(batch: int, pages_per_row: int) -> jax.Array:
    """The page table of a cache whose rows own consecutive pages, 1 .. batch * pages_per_row (page 0
    is the null page): a batch's cache outside a server."""
    return (1 + jnp.arange(batch * pages_per_row, dtype=jnp.int32)).reshape(batch, pages_per_row)


def pool_slot(pages_ref, b, slot, page_size: int):
    """Inside a kernel: the pool slot of row b's logical slot `slot` (>= 0, inside the table;
    elementwise for a vector of slots): a key block's first slot, or each slot of a gather. With
    page_size / block_size entries a page, the same for compressed entries. lax's division: jnp's // and
    % sign fix-ups cost a float32 NSA-1B tile a register spill (ptxas, sm_90)."""
    return pages_ref[b, jax.lax.div(slot, page_size)] * page_size + jax.lax.rem(slot, page_size)
