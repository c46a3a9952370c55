"""The kernel layout of packed MXFP4 expert weights: made once on the device at load, proven exact against the
checkpoint.

Checkpoint layout (K3_FACTS §4): values ``[E, N, K/2]`` u8 (element 2i in the low nibble of byte i), scales
``[E, N, K/32]`` u8 E8M0, row-major; a GEMM program that owns an n-tile reads, per k-step, a 32-64-byte
fragment of each row and a 2-4-byte scale fragment from another tensor (and, for w1|w3, the up rows ``I``
rows away from the gate rows).

Tiled layout (this module): one u8 buffer ``[E, NT, KT, CHUNK]`` where ``NT = ceil(N_g / tile_n)`` n-tiles of
``tile_n`` rows per row group, ``KT = K / tile_k`` k-tiles and ``CHUNK = G * tile_n * (tile_k/2 + tile_k/32)``
bytes. Chunk ``(e, nt, kt)`` holds everything one program needs for one k-tile of one n-tile, contiguous:

* the values of the ``G * tile_n`` rows ``g * tile_n + i`` (row group g, row ``nt * tile_n + i`` of that group),
  each ``tile_k/2`` bytes, row after row (byte order within a row as in the checkpoint);
* then the scales of the same rows, ``tile_k/32`` bytes each, in the same row order.

``G = 2`` for w1|w3 (group 0 = gate rows ``0..I-1``, group 1 = up rows ``I..2I-1``: gate and up rows of an
n-tile interleaved per tile), ``G = 1`` for w2. Rows past ``N_g`` in the last n-tile are zero bytes (value 0,
scale 2^-127; the kernels mask those columns). Byte offset of value byte ``j`` (elements ``2j, 2j+1`` of the
row) of row ``n`` of group ``g``::

    chunk(n // tile_n, j // (tile_k/2)) + (g * tile_n + n % tile_n) * tile_k/2 + j % (tile_k/2)

and of the scale of block ``b`` (elements ``32b .. 32b+31``)::

    chunk(n // tile_n, b // (tile_k/32)) + G * tile_n * tile_k/2 + (g * tile_n + n % tile_n) * tile_k/32
        + b % (tile_k/32)

with ``chunk(nt, kt) = ((e * NT + nt) * KT + kt) * CHUNK``.

Bits within a value word (``bits``): 0 = the checkpoint's nibbles (element 8w + j of little-endian word w in
bits 4j .. 4j+3, sign on top: what ``tl.dot_scaled`` and the scaled MFMA read). 1 = *planar*: each 16-bit lane
of a word (lane 0 = elements 8w .. 8w+3, lane 1 = elements 8w+4 .. 8w+7) holds element j of its four with the
magnitude bits ``e1 e0 m`` at lane bits ``PLANAR_MAG[j] .. +2`` and the sign at ``PLANAR_SIGN[j]``. The decode
places each code at bf16 bits 6-8 (magnitude) and 15 (sign), two elements (j, j+4) per 32-bit operation; from
the checkpoint nibbles that is two shifts and two masks per pair, from the planar lanes pair 2 is one mask, pair 1
one shift and one mask, pairs 0 and 3 two shifts and two masks (on sm_90 the w1|w3 k-step of m16n128k128 drops
from 134 to 102 LOP3 and from 41 to 31 SHF per thread). No lane layout puts every pair one shift away (no
translate of {6,7,8,15} tiles the 16 lane bits four times), so two pairs stay at four operations.

Element order within a 32-element block (``order``): 0 = the checkpoint's (word q of a block holds elements
8q .. 8q+7, element 8q + i in nibble i). 1 = *mma*: word q holds the elements one thread of a Hopper MMA takes as
its register operand across the block's two k16 steps, nibble i = j + 4b holding element ``8j + 2q + b``
(:data:`MMA_ORDER`). The decode joins nibbles j and j+4 of a word into one register and places pair (j, b) of
word q at K position ``8j + 2q + b`` (``moe.gemm.mxfp4_decode_tile`` with ``MMA_ORDER``), so from this order the
decoded tile comes out in the natural K order: the GEMM reads its activations as they are, instead of permuting
each activation tile to the decode's order through registers and shared memory. Value bits (``bits``) apply on
top of either order.

The layout is a permutation of the checkpoint's bits (plus zero padding), so :func:`unpack_mxfp4` recovers the
checkpoint tensors bit for bit and :func:`check_repack` proves that the kernel sees exactly the checkpoint's
values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from k3rocm.errors import ConfigError

#: planar value bits (module docstring): lane bit of the magnitude's low bit / of the sign of element j (0..3)
PLANAR_MAG = (0, 3, 6, 9)
PLANAR_SIGN = (13, 12, 15, 14)
BIT_LAYOUTS = {0: "nibble", 1: "planar"}
#: element orders within a 32-element block (module docstring)
ORDER_LAYOUTS = {0: "checkpoint", 1: "mma"}
#: order 1: the element stored in nibble slot ``s = 8q + i`` of a block (word q, nibble i = j + 4b) is
#: ``8j + 2q + b`` (j = i % 4, b = i // 4); a permutation of 0..31
MMA_ORDER = tuple(8 * (s % 8 % 4) + 2 * (s // 8) + (s % 8) // 4 for s in range(32))
_LUTS: dict[tuple[int, str], torch.Tensor] = {}


def _lane_lut(inverse: bool, device: torch.device) -> torch.Tensor:
    """int32 [65536]: the planar lane of a checkpoint lane (``inverse``: the checkpoint lane of a planar one)."""
    key = (int(inverse), str(device))
    if key not in _LUTS:
        v = torch.arange(1 << 16, dtype=torch.int32)
        out = torch.zeros_like(v)
        for j in range(4):
            if inverse:
                mag, sgn = (v >> PLANAR_MAG[j]) & 7, (v >> PLANAR_SIGN[j]) & 1
                out |= (mag | (sgn << 3)) << (4 * j)
            else:
                nib = (v >> (4 * j)) & 15
                out |= ((nib & 7) << PLANAR_MAG[j]) | ((nib >> 3) << PLANAR_SIGN[j])
        _LUTS[key] = out.to(device)
    return _LUTS[key]


#: value bytes permuted at once by :func:`permute_value_bits` (its int32 temporaries are 4-6 x this)
PERMUTE_STEP_BYTES = 32 << 20


def permute_block_order(values: torch.Tensor, to_mma: bool) -> torch.Tensor:
    """Checkpoint element order -> the mma order (``to_mma``) or back, of u8 value bytes whose last dim is a
    multiple of 16 (each 16 bytes one 32-element MXFP4 block; module docstring): slot s of a block takes element
    :data:`MMA_ORDER` [s] (and back: element :data:`MMA_ORDER` [s] returns to slot s). A new contiguous tensor of
    the same shape on the same device; a bijection on the nibbles of each block.

    Raises ConfigError if ``values`` is not u8 or its last dim is not a multiple of 16."""
    if values.dtype != torch.uint8 or values.shape[-1] % 16:
        raise ConfigError(f"MXFP4 block order: need u8 bytes in 16-byte blocks, got {values.dtype} "
                          f"{tuple(values.shape)}")
    perm = torch.tensor(MMA_ORDER, dtype=torch.long, device=values.device)
    src = values.contiguous()
    out = torch.empty_like(src)
    flat_src, flat_out = src.view(-1, 16), out.view(-1, 16)
    rows = max(1, PERMUTE_STEP_BYTES // 16)
    for i in range(0, flat_src.shape[0], rows):
        v = flat_src[i:i + rows]
        nib = torch.stack((v & 15, v >> 4), dim=-1).reshape(-1, 32)  # element 2i in the low nibble of byte i
        if to_mma:
            nib = nib.index_select(1, perm)
        else:
            nib = torch.empty_like(nib).index_copy_(1, perm, nib)
        nib = nib.reshape(-1, 16, 2)
        flat_out[i:i + rows] = nib[..., 0] | (nib[..., 1] << 4)
    return out


def permute_value_bits(values: torch.Tensor, to_planar: bool) -> torch.Tensor:
    """Checkpoint nibbles -> planar lanes (``to_planar``) or back, of u8 value bytes whose last dim is even
    (each pair of bytes one little-endian 16-bit lane; a word's two lanes are permuted alike). A new contiguous
    tensor of the same shape on the same device, made :data:`PERMUTE_STEP_BYTES` at a time; a bijection, so
    ``permute_value_bits(permute_value_bits(x, True), False) == x``.

    Raises ConfigError if ``values`` is not u8 or its last dim is odd."""
    if values.dtype != torch.uint8 or values.shape[-1] % 2:
        raise ConfigError(f"MXFP4 value bits: need u8 bytes in pairs, got {values.dtype} {tuple(values.shape)}")
    src = values.contiguous().view(-1)
    out = torch.empty_like(src)
    lut = _lane_lut(not to_planar, values.device)
    for i in range(0, src.numel(), PERMUTE_STEP_BYTES):
        b = src[i:i + PERMUTE_STEP_BYTES].view(-1, 2).to(torch.int32)
        lane = lut.index_select(0, b[:, 0] | (b[:, 1] << 8))
        o = out[i:i + PERMUTE_STEP_BYTES].view(-1, 2)
        o[:, 0] = lane & 0xFF
        o[:, 1] = lane >> 8
    return out.view(values.shape)


@dataclass
class TiledMxfp4:
    """One stacked MXFP4 weight in the tiled kernel layout (module docstring).

    data ``[E, NT, KT, CHUNK]`` u8 on the device of the source; rows = N_g (rows per group, unpadded); k = K
    (elements per row); groups = G (2: w1|w3 gate/up, 1: w2); tile_n, tile_k = rows and elements per chunk;
    repack_s = wall seconds of the repack (device synchronised when on a GPU); max_scale = the largest E8M0 byte;
    bits = bits within a value word (0 nibble, 1 planar); order = element order within a block (0 checkpoint,
    1 mma; module docstring).
    """

    data: torch.Tensor
    rows: int
    k: int
    groups: int
    tile_n: int
    tile_k: int
    repack_s: float = 0.0
    max_scale: int = 255
    bits: int = 0
    order: int = 0

    @property
    def num_experts(self) -> int:
        return self.data.shape[0]

    @property
    def stride_expert(self) -> int:
        """Bytes per expert (``NT * KT * CHUNK``)."""
        return self.data.shape[1] * self.data.shape[2] * self.data.shape[3]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def experts(self, first: int, end: int) -> "TiledMxfp4":
        """Local experts ``first .. end-1`` (a view of the same bytes: the expert is the leading dim)."""
        return replace(self, data=self.data[first:end])

    def to(self, device: str | torch.device) -> "TiledMxfp4":
        """The same layout with its bytes on ``device`` (shared when already there)."""
        return replace(self, data=self.data.to(device))


def fit_tile_k(tile_k: int, k: int) -> int:
    """The largest ``tile_k / 2^j >= 32`` that divides ``k`` (the layout's k-tile for rows of ``k`` elements).

    Raises ConfigError if ``k`` is not a multiple of 32 (the MXFP4 block)."""
    tk = tile_k
    while tk > 32 and k % tk:
        tk //= 2
    if k % 32 or k % tk:
        raise ConfigError(f"MXFP4 layout: row width {k} is not a multiple of 32 (the MXFP4 block)")
    return tk


#: bytes of source experts a repack or a check handles at once (bounds their temporaries on the device)
EXPERT_CHUNK_BYTES = 256 << 20


def expert_chunk(packed: torch.Tensor) -> int:
    """Experts per step of a repack / check: as many as fit :data:`EXPERT_CHUNK_BYTES` of ``packed``, >= 1."""
    per = max(1, packed[0].numel()) if packed.shape[0] else 1
    return max(1, EXPERT_CHUNK_BYTES // per)


def repack_mxfp4(packed: torch.Tensor, scale: torch.Tensor, groups: int, tile_n: int, tile_k: int,
                 bits: int = 0, order: int = 0) -> TiledMxfp4:
    """Repack checkpoint-layout MXFP4 ``packed [E, G*N_g, K/2]`` u8 + ``scale [E, G*N_g, K/32]`` u8 into the
    tiled layout, on their device (torch ops only; no host round trip).

    ``tile_k`` is fitted to K with :func:`fit_tile_k`; ``tile_n`` must be a multiple of 16; ``bits``: 0 keeps the
    checkpoint nibbles, 1 stores planar lanes; ``order``: 0 the checkpoint's element order within a block, 1 the
    mma order (module docstring).
    Raises ConfigError on shapes that do not match, a bad tile or an unknown ``bits`` / ``order``.
    """
    if bits not in BIT_LAYOUTS:
        raise ConfigError(f"repack_mxfp4: bits {bits!r} is not one of {sorted(BIT_LAYOUTS)} (0 nibble, 1 planar)")
    if order not in ORDER_LAYOUTS:
        raise ConfigError(f"repack_mxfp4: order {order!r} is not one of {sorted(ORDER_LAYOUTS)} (0 checkpoint, 1 mma)")
    if packed.dim() != 3 or scale.dim() != 3 or packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ConfigError(f"repack_mxfp4: need u8 [E, N, K/2] and [E, N, K/32], got {tuple(packed.shape)} "
                          f"{packed.dtype} and {tuple(scale.shape)} {scale.dtype}")
    E, N, K2 = packed.shape
    K = 2 * K2
    if scale.shape != (E, N, K // 32) or N % groups or tile_n % 16:
        raise ConfigError(f"repack_mxfp4: scale {tuple(scale.shape)} does not fit packed {tuple(packed.shape)} "
                          f"with {groups} row groups and tile_n {tile_n}")
    sync = packed.is_cuda
    if sync:
        torch.cuda.synchronize(packed.device)
    t0 = time.perf_counter()
    tk = fit_tile_k(tile_k, K)
    ng = N // groups
    nt = -(-ng // tile_n)
    kt = K // tk

    def tiles(x: torch.Tensor, per_row: int) -> torch.Tensor:  # [e, G*N_g, KT*per_row] -> [e, NT, KT, G*tn*per_row]
        n = x.shape[0]
        x = x.reshape(n, groups, ng, kt, per_row)
        if nt * tile_n != ng:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, nt * tile_n - ng))
        x = x.reshape(n, groups, nt, tile_n, kt, per_row).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(n, nt, kt, groups * tile_n * per_row)

    vb = groups * tile_n * (tk // 2)
    data = torch.empty(E, nt, kt, vb + groups * tile_n * (tk // 32), dtype=torch.uint8, device=packed.device)
    # a few experts at a time, so the temporaries stay ~EXPERT_CHUNK_BYTES next to the source and the result
    step = expert_chunk(packed)
    for a in range(0, E, step):
        b = min(E, a + step)
        v = tiles(packed[a:b], tk // 2)
        if order:  # each row's tk // 2 bytes are whole 16-byte blocks (tk is a multiple of 32)
            v = permute_block_order(v, True)
        data[a:b, ..., :vb] = permute_value_bits(v, True) if bits else v
        data[a:b, ..., vb:] = tiles(scale[a:b], tk // 32)
    max_scale = int(scale.max()) if scale.numel() else -1  # one reduction + host read, at load only
    if sync:
        torch.cuda.synchronize(packed.device)
    return TiledMxfp4(data, ng, K, groups, tile_n, tk, time.perf_counter() - t0, max_scale, bits, order)


def _untile(t: TiledMxfp4) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiled bytes in checkpoint order (planar value bits read back as nibbles, the mma element order as the
    checkpoint's), padding rows kept: ``[E, G, NT*tile_n, K/2]``, ``[E, G, NT*tile_n, K/32]``."""
    E, nt, kt, _ = t.data.shape
    G, tn, tk = t.groups, t.tile_n, t.tile_k
    vbytes = G * tn * (tk // 2)
    vals = permute_value_bits(t.data[..., :vbytes], False) if t.bits else t.data[..., :vbytes]
    if t.order:
        vals = permute_block_order(vals, False)

    def untile(x: torch.Tensor, per_row: int) -> torch.Tensor:
        return x.reshape(E, nt, kt, G, tn, per_row).permute(0, 3, 1, 4, 2, 5).reshape(E, G, nt * tn, kt * per_row)

    return untile(vals, tk // 2), untile(t.data[..., vbytes:], tk // 32)


def unpack_mxfp4(t: TiledMxfp4) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`repack_mxfp4`: ``(packed [E, G*N_g, K/2] u8, scale [E, G*N_g, K/32] u8)``, read back
    from the tiled bytes with the layout's own addressing (padding rows dropped)."""
    E = t.data.shape[0]
    p, s = _untile(t)
    return (p[:, :, : t.rows].reshape(E, t.groups * t.rows, -1).contiguous(),
            s[:, :, : t.rows].reshape(E, t.groups * t.rows, -1).contiguous())


def check_repack(t: TiledMxfp4, packed: torch.Tensor, scale: torch.Tensor) -> dict:
    """Prove that the tiled tensor holds exactly the checkpoint's MXFP4 values: every value byte (two E2M1
    codes) and every E8M0 scale byte read back through the layout equals the checkpoint's, and every padding
    byte is zero. Byte equality of codes and scales is equality of the decoded values (the decode is a function
    of the code and its block's scale alone). Runs on the tensors' device.

    Returns ``{"bytes": tiled bytes, "checkpoint_bytes": ..., "repack_s": ...}``.
    Raises ConfigError naming the first mismatching expert when a byte differs.
    """
    E = t.data.shape[0]
    if packed.shape[0] != E or scale.shape[0] != E:
        raise ConfigError(f"MXFP4 layout check: {E} tiled experts, checkpoint {tuple(packed.shape)}/{tuple(scale.shape)}")
    pad_ok, bads = True, []
    step = expert_chunk(packed)
    for a in range(0, E, step):  # a few experts at a time (bounded temporaries)
        b = min(E, a + step)
        pp, ps = _untile(t.experts(a, b))
        pad_ok = pad_ok and not (pp[:, :, t.rows:].any() or ps[:, :, t.rows:].any())
        p = pp[:, :, : t.rows].reshape(b - a, t.groups * t.rows, -1)
        s = ps[:, :, : t.rows].reshape(b - a, t.groups * t.rows, -1)
        if p.shape[1:] != packed.shape[1:] or s.shape[1:] != scale.shape[1:]:
            raise ConfigError(f"MXFP4 layout check: read back {tuple(p.shape[1:])}/{tuple(s.shape[1:])} per expert, "
                              f"checkpoint {tuple(packed.shape[1:])}/{tuple(scale.shape[1:])}")
        bads.append(((p != packed[a:b]).flatten(1).any(1) | (s != scale[a:b]).flatten(1).any(1)).nonzero() + a)
    bad = torch.cat(bads) if bads else torch.zeros(0, dtype=torch.long)
    if bad.numel() or not pad_ok:
        first = int(bad[0]) if bad.numel() else -1
        raise ConfigError(f"MXFP4 layout check: tiled bytes differ from the checkpoint (first expert {first}; "
                          f"padding zero: {pad_ok}); the repack is wrong")
    return {"bytes": t.nbytes, "checkpoint_bytes": packed.numel() + scale.numel(), "repack_s": t.repack_s}
