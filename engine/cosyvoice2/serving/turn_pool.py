"""Turns in flight keep their decoder state in a paged pool: a chunk costs its own frames.

In streaming mode the flow's estimator is chunk-causal: a frame sees its own 50-frame chunk
and the chunks before it, and every convolution is causal. So once a turn's chunk is whole
(its tokens and their look-ahead are all there), its decoder state never changes: per Euler
step and CFG row, the keys and values of every attention layer, and each causal
convolution's input at its last frames. A later call may start its decoder after the
turn's committed chunks and attend to their stored keys and values instead of recomputing
them, as a call after the voice prefix does (prefix_bank.py). The same mel, for the cost of
the new frames.

That state is large (~2.3 MB per frame at full size in bf16, 10 steps x 2 rows x 56 layers
x K and V x 512 values at the official step count; it scales with ``flow_steps``), so it
lives in a pool of fixed pages of one attention chunk each, sized by a memory budget, and a
turn holds pages only while it is being generated: they go back the moment it ends or is
cancelled. When the pool is full a turn keeps what it has and its call recomputes from its
last stored chunk (a fallback, counted), so nothing fails.

Rows of one call may hold different numbers of pages: each row reads its voice prefix from
the bank, its pages through a page table padded with a scratch page (masked), then its new
frames. Every shape depends on the bucket only, so a CUDA graph of an Euler step reads and
writes the pool in place (flow_graphs.py). Committed chunks are written to their pages in
the same pass; rows that commit nothing write to the scratch page and scratch slot, which
no real row reads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tts_gateway.engine.cosyvoice2.model.cfm import CFM, N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.model.estimator import chunk_attention_mask
from tts_gateway.engine.cosyvoice2.model.flow import Flow, gather_frames
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import PrefixBank, PrefixView


@dataclass
class TurnState:
    """One turn's share of the pool: its pages (committed chunks after the voice prefix, in
    order) and the slot of its convolutions' left context."""

    slot: int
    pages: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class TurnRows:
    """Where each row of a call stands in the bank and the pool (B rows; what a CUDA graph of a
    paged call takes as static inputs besides the decoder's).

    slots ``[B]``: the voice prefix's bank slot; page_table ``[B, P]``: the row's stored pages,
    then the scratch page; cached ``[B]``: how many of them are its; turn_slot ``[B]``: its
    conv-context slot (scratch without one); write_pages ``[B, W]``: where the call's new
    chunks go (chunk c of the new frames to page c; scratch where not committed); commit
    ``[B]``: new frames committed (whole chunks).
    """

    slots: Tensor
    page_table: Tensor
    cached: Tensor
    turn_slot: Tensor
    write_pages: Tensor
    commit: Tensor

    def as_tuple(self) -> tuple[Tensor, ...]:
        return self.slots, self.page_table, self.cached, self.turn_slot, self.write_pages, self.commit


class TurnStatePool:
    """Decoder state of turns in flight, in pages of one attention chunk (see the module).

    ``keys[layer]`` / ``values[layer]``: ``[steps, pages + 1, 2, heads, page_frames, head_dim]``;
    ``conv_context[conv]``: ``[steps, pages + 1, 2, channels, kernel - 1]`` by turn slot (a turn
    holding state holds a page, so there are as many slots as pages). The last page and slot
    are scratch. ``steps``: the Euler steps of the solves over the pool (the voice-prefix bank
    they read must be laid out for as many). Thread-safe: turns grow on the token2wav thread
    and are released from others.
    """

    def __init__(self, cfm: CFM, pages: int, like: Tensor, steps: int = N_TIMESTEPS) -> None:
        if pages < 1:
            raise ValueError(f"a turn-state pool needs >= 1 page, got {pages}")
        self.steps = steps
        self.pages = pages
        self.page_frames = cfm.config.estimator.static_chunk_size
        self.scratch = pages  # the index of the scratch page and of the scratch slot
        self.keys = [
            like.new_zeros(steps, pages + 1, 2, layer.heads, self.page_frames, layer.head_dim)
            for layer in cfm.estimator.attention_layers
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.conv_context = [
            like.new_zeros(steps, pages + 1, 2, conv.in_channels, conv.context) for conv in cfm.estimator.causal_convs
        ]
        self._lock = threading.Lock()
        self._free_pages = list(range(pages - 1, -1, -1))
        self._free_slots = list(range(pages - 1, -1, -1))
        # Running totals (the engine exports them): the most pages held at once, pages and
        # turns given state, and calls of a turn that could not store its new chunks.
        self.peak_pages = 0
        self.pages_stored = 0
        self.turns = 0
        self.fallbacks = 0

    @staticmethod
    def page_bytes(cfm: CFM, dtype: torch.dtype, steps: int = N_TIMESTEPS) -> int:
        """Bytes of one page (and its share of a conv slot) at this size, dtype and step count."""
        chunk = cfm.config.estimator.static_chunk_size
        attention = sum(2 * layer.heads * layer.head_dim * chunk for layer in cfm.estimator.attention_layers)
        conv = sum(conv.in_channels * conv.context for conv in cfm.estimator.causal_convs)
        return steps * 2 * (attention + conv) * torch.empty(0, dtype=dtype).element_size()

    @classmethod
    def within(cls, cfm: CFM, budget_bytes: int, like: Tensor, steps: int = N_TIMESTEPS) -> TurnStatePool:
        """The largest pool (plus its scratch page) that fits ``budget_bytes``."""
        pages = budget_bytes // cls.page_bytes(cfm, like.dtype, steps) - 1
        if pages < 1:
            raise ValueError(f"a budget of {budget_bytes / 2**30:.2f} GiB holds no page of decoder state")
        return cls(cfm, pages, like, steps)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, *self.conv_context))

    def totals(self) -> dict[str, float]:
        """The pool's running totals, in bytes where they are memory (see ``__init__``)."""
        page = self.nbytes / (self.pages + 1)
        with self._lock:
            return {
                "peak_bytes": self.peak_pages * page, "stored_bytes": self.pages_stored * page,
                "turns": self.turns, "fallbacks": self.fallbacks,
            }

    @property
    def pages_in_use(self) -> int:
        with self._lock:
            return self.pages - len(self._free_pages)

    def grow(self, turn: TurnState | None, pages: int) -> TurnState | None:
        """``turn`` (a new one when None) with ``pages`` more pages, or None when the pool has
        too few free (then nothing is taken, and the call counts as a fallback)."""
        with self._lock:
            if len(self._free_pages) < pages or (turn is None and not self._free_slots):
                self.fallbacks += 1
                return None
            if turn is None:
                turn = TurnState(self._free_slots.pop())
                self.turns += 1
            turn.pages += [self._free_pages.pop() for _ in range(pages)]
            self.pages_stored += pages
            self.peak_pages = max(self.peak_pages, self.pages - len(self._free_pages))
            return turn

    def release(self, turn: TurnState) -> None:
        """Give a turn's pages and slot back (the turn ended, or was cancelled)."""
        with self._lock:
            self._free_pages += turn.pages
            self._free_slots.append(turn.slot)
            turn.pages = []


class PagedView(PrefixView):
    """One Euler step of a call whose rows start after their voice prefix and their stored
    chunks: keys are the bank's prefix frames, the row's pages, then the new frames; the new
    chunks a row commits are written to its pages, and its conv context to its slot."""

    def __init__(self, bank: PrefixBank, pool: TurnStatePool, rows: TurnRows) -> None:
        if bank.steps != pool.steps:
            raise ValueError(f"a bank of {bank.steps} Euler steps with a pool of {pool.steps}")
        super().__init__(bank, rows.slots)
        self.pool = pool
        self.prefix_len = self.start
        self.page_table = rows.page_table.repeat(2, 1)
        self.cached = rows.cached.repeat(2)
        self.write_pages = rows.write_pages.repeat(2, 1)
        self.commit = rows.commit.repeat(2)
        self.read_slot = rows.turn_slot.repeat(2)
        self.write_slot = torch.where(self.commit > 0, self.read_slot, pool.scratch)
        self.start = self.prefix_len + self.cached * pool.page_frames

    def _index(self, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(step, index, CFG row) into a pool tensor, the step and row shaped to broadcast with
        ``index`` (``[2B]`` or ``[2B, n]``)."""
        shape = (len(self.branch),) + (1,) * (index.dim() - 1)
        step = self.step if isinstance(self.step, Tensor) else torch.full((1,), self.step, device=index.device)
        return step.expand(len(self.branch)).view(shape), index, self.branch.view(shape)

    def attention_mask(self, new_frames: Tensor, positions: Tensor, chunk: int) -> Tensor:
        page_span = torch.arange(self.page_table.shape[1] * self.pool.page_frames, device=positions.device)
        prefix_pos = torch.arange(self.bank.frames, device=positions.device).expand(len(self.start), -1)
        key_pos = torch.cat([prefix_pos, self.prefix_len[:, None] + page_span, self.start[:, None] + positions], dim=1)
        key_valid = torch.cat([
            prefix_pos < self.prefix_len[:, None],
            page_span < (self.cached * self.pool.page_frames)[:, None],
            positions < new_frames[:, None],
        ], dim=1)
        return chunk_attention_mask(key_valid, self.start[:, None] + positions, chunk, key_pos)

    def keys_values(self, slot: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        out = []
        for bank_part, pool_part, new in ((self.bank.keys, self.pool.keys, key), (self.bank.values, self.pool.values, value)):
            stored = pool_part[slot]
            self._write_chunks(stored, new)
            pages = stored[self._index(self.page_table)]  # [2B, P, heads, F, head_dim]
            rows, count, heads, frames, dim = pages.shape
            pages = pages.permute(0, 2, 1, 3, 4).reshape(rows, heads, count * frames, dim)
            out.append(torch.cat([self._rows(bank_part[slot]), pages, new], dim=2))
        return out[0], out[1]

    def _write_chunks(self, stored: Tensor, new: Tensor) -> None:
        """Chunk c of the new frames' keys (or values) to page ``write_pages[:, c]``."""
        rows, heads, frames, dim = new.shape
        width = self.write_pages.shape[1] * self.pool.page_frames
        if frames > width:
            raise ValueError(f"{frames} new frames, but pages for {width}")
        if frames < width:
            new = torch.nn.functional.pad(new, (0, 0, 0, width - frames))
        chunks = new.view(rows, heads, -1, self.pool.page_frames, dim).transpose(1, 2)
        stored.index_put_(self._index(self.write_pages), chunks)

    def conv_input(self, slot: int, x: Tensor) -> Tensor:
        stored = self.pool.conv_context[slot]
        from_turn = stored[self._index(self.read_slot)]
        context = torch.where((self.cached > 0)[:, None, None], from_turn, self._rows(self.bank.conv_context[slot]))
        extended = torch.cat([context, x], dim=2)
        # extended[:, :, e] is frame start - context + e: the context after the committed
        # frames is extended[:, :, commit : commit + context].
        take = self.commit[:, None] + torch.arange(context.shape[2], device=x.device)
        stored.index_put_(self._index(self.write_slot), extended.gather(2, take[:, None].expand(-1, x.shape[1], -1)))
        return extended


def pad_turn_rows(rows: TurnRows, pool: TurnStatePool, batch: int, pages: int, frames: int) -> TurnRows:
    """``rows`` padded to a graph's shape: ``batch`` rows, page tables ``pages`` wide, pages to
    write for ``frames`` new frames. Padding rows read row 0's state and keep nothing (scratch
    slot and pages, commit 0); tables and pages to write are padded with the scratch page."""
    scratch = pool.scratch
    writes = -(-frames // pool.page_frames)

    def padded(index: Tensor, width: int, fill: int | None) -> Tensor:
        index = torch.nn.functional.pad(index, (0, width - index.shape[1]), value=scratch)
        extra = batch - index.shape[0]
        tail = index[:1].expand(extra, -1) if fill is None else index.new_full((extra, width), fill)
        return torch.cat([index, tail])

    def one(index: Tensor, fill: int | None) -> Tensor:
        return padded(index[:, None], 1, fill)[:, 0]

    return TurnRows(
        one(rows.slots, None), padded(rows.page_table, pages, None), one(rows.cached, None),
        one(rows.turn_slot, scratch), padded(rows.write_pages, writes, scratch), one(rows.commit, 0),
    )


def paged_noise(cfm: CFM, bank: PrefixBank, pool: TurnStatePool, rows: TurnRows, frames: int) -> Tensor:
    """The fixed noise of ``frames`` frames from each row's start (after its prefix and pages)."""
    start = bank.start[rows.slots] + rows.cached * pool.page_frames
    widest = bank.frames + rows.page_table.shape[1] * pool.page_frames + frames
    noise = cfm.noise[:, :, :widest].expand(len(start), -1, -1)
    return gather_frames(noise, start, frames)


def solve_paged(
    cfm: CFM, bank: PrefixBank, pool: TurnStatePool, rows: TurnRows, mu: Tensor, mask: Tensor, spks: Tensor,
    cond: Tensor,
) -> Tensor:
    """Streaming-mode mel of each row's frames after its voice prefix and stored chunks (row b's
    column i is frame ``bank.start[slots[b]] + cached[b] * page_frames + i``), storing the
    chunks each row commits. Equals the same frames of a whole streaming solve."""
    view = PagedView(bank, pool, rows)
    noise = paged_noise(cfm, bank, pool, rows, mu.shape[2]).to(mu.dtype)
    return cfm.solve(noise, mask, mu, spks, cond, True, pool.steps, view.at_step)


# (rows, mu, mask, spks, cond) -> the mel of a paged call (solve_paged, or a CUDA graph's replay)
SolvePaged = Callable[[TurnRows, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class PagedResult:
    """A paged call's decoder mel ``[B, 80, width]``: row b's column i is frame start[b] + i, up
    to end[b] (frames counted from the start of the prompt)."""

    mel: Tensor
    start: Tensor
    end: Tensor


@torch.inference_mode()
def flow_paged(
    flow: Flow, bank: PrefixBank, pool: TurnStatePool, slots: Tensor, turns: list[TurnState | None],
    args: tuple[Tensor, ...], finalize: bool, keep: list[bool], solve: SolvePaged | None = None,
) -> tuple[PagedResult, list[TurnState | None]]:
    """A streaming flow call of these rows (``args`` as ``Flow.decoder_inputs``) that starts each
    row after its voice prefix (bank slot ``slots[b]``) and its turn's stored chunks
    (``turns[b]``, None: none yet), and stores the whole chunks it completes for the rows
    that ``keep`` state (not on the last chunk: nothing follows it). Returns the mel and the
    turns (one that could not grow, the pool being full, keeps what it had).

    ``solve``: the decoder (default :func:`solve_paged`, eager; the runner passes a graph's replay).
    """
    device = slots.device
    chunk = pool.page_frames
    stored = [len(t.pages) if t is not None else 0 for t in turns]
    cached = torch.tensor(stored, device=device)
    start = bank.start[slots] + cached * chunk
    inputs = flow.decoder_inputs(*args, True, finalize, start=start)
    end = start + inputs.mask[:, 0].sum(dim=1).long()
    # Whole chunks completed by this call (start is a chunk boundary), one page each.
    fresh = [max(0, e // chunk - s // chunk) if k else 0 for s, e, k in zip(start.tolist(), end.tolist(), keep)]
    turns = list(turns)
    for b, count in enumerate(fresh):
        if count:
            grown = pool.grow(turns[b], count)
            if grown is None:
                fresh[b] = 0
            else:
                turns[b] = grown
    # The index tensors, built on the host and copied once.
    scratch, writes = pool.scratch, max(1, -(-inputs.mu.shape[2] // chunk))
    table, write_pages, turn_slot = [], [], []
    for turn, n, count in zip(turns, stored, fresh):
        pages = turn.pages if turn is not None else []
        table.append(pages[:n] + [scratch] * (max(stored) - n))
        write_pages.append(pages[n : n + count] + [scratch] * (writes - count))
        turn_slot.append(turn.slot if turn is not None else scratch)
    rows = TurnRows(
        slots, torch.tensor(table, dtype=torch.long).to(device), cached, torch.tensor(turn_slot).to(device),
        torch.tensor(write_pages, dtype=torch.long).to(device), torch.tensor(fresh).to(device) * chunk,
    )
    if solve is None:
        def solve(rows, mu, mask, spks, cond):
            return solve_paged(flow.decoder, bank, pool, rows, mu, mask, spks, cond)
    mel = solve(rows, inputs.mu, inputs.mask, inputs.spk, inputs.cond)
    return PagedResult(mel, start, end), turns
