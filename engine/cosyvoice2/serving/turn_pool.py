"""Turns in flight keep their decoder state in a paged pool: a chunk costs its own frames.

In streaming mode the flow's estimator is chunk-causal: a frame sees its own 50-frame chunk
and the chunks before it, and every convolution is causal. So once a turn's chunk is whole
(its tokens and their look-ahead are all there), its decoder state never changes: per Euler
step and CFG row, the input of every attention layer (its keys and values are linear in it),
and each causal convolution's input at its last frames. A later call may start its decoder
after the turn's committed chunks and attend over their stored inputs instead of
recomputing them. The same mel, for the cost of the new frames.

Why inputs, not keys and values: a layer's input is ``dim`` (256) values per frame, its keys
and values 2 x 512. The estimator's attention layers attend over inputs directly (query and
output carried through the key and value weights, ``SelfAttention``): the same attention,
from a quarter of the memory, for four times the attention arithmetic (the paged attention
was ~22% of the decoder's kernel time at 64 sessions on an H100: docs/benchmarks.md). The
pool folds those carries into the projections when it is built: two matrix products per
layer around the attention, fewer kernels for twice the projection arithmetic.

Layout. Inputs live in pages of 16 frames, ``[pages, 16, 1, dim]`` per layer, the layout of
vLLM's paged FlashAttention kernel, which reads them where they lie as the keys and the
values of one head that all query heads share (paged_varlen.py: a call's attention is one
varlen call, a query piece per attention chunk, so the chunk-causal rule needs no mask). A
row's page table lists, position by position, its voice prefix's pages (shared by every turn
of that voice, copied from the prefix bank when a voice takes a bank slot), then its turn's
own pages. The prefix's last page, when the prefix ends inside it, is copied into the turn's
first own page, since the turn's frames continue in it. Every attention layer first writes
the new frames' inputs into their pages (all of them: the kernel reads only pages), then
attends. A logical page ``p`` is one page per Euler step and CFG row: physical page ``(step *
2 + row) * (pages + 1) + p``, so one page table serves every step and row by an offset. Conv
context stays per turn slot.

Memory: ~0.57 MB per frame at full size in bf16 (10 steps x 2 rows x 56 layers x 256 values),
so the pool is sized by a budget and a turn holds pages only while it is being generated:
they go back the moment it ends or is cancelled. A call allocates the pages its new frames
need first; a turn that cannot get them (the pool is full, or the turn outgrew the
page table) gives its pages back and goes on by recompute (the runner's calls without the
pool; a fallback, counted), so nothing fails. A new turn gets pages only while some of the
pool stays free for the turns already in it to grow, so that turns admitted finish in it; a
turn that fell back comes back on the same terms (a return, counted): its next call costs the
whole turn after its voice prefix either way, and then stores it.

Every shape depends on the call's bucket only (the page table has a fixed width), so a CUDA
graph of an Euler step reads and writes the pool in place (flow_graphs.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from tts_gateway.engine.cosyvoice2.model.cfm import CFM, N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.model.flow import DecoderInputs, Flow, gather_frames
from tts_gateway.engine.cosyvoice2.serving.fused_context import ContextRows, conv_input
from tts_gateway.engine.cosyvoice2.serving.paged_varlen import ChunkSequences, attend_reference, chunk_sequences
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import PrefixBank, PrefixView
from tts_gateway.engine.cosyvoice2.serving.uploads import to_device

# The paged kernel's page size (a multiple of 16 frames): small pages waste little at a
# prefix's or a turn's end.
PAGE_FRAMES = 16
# Pages of a row's table: positions up to 8192 frames (164 s, voice prefix included). A turn
# longer than that runs its later chunks on the recompute path.
TABLE_PAGES = 512
# Turn slots (conv context) per page of the pool: a turn holds a few pages at least.
PAGES_PER_TURN_SLOT = 4
# A new turn is given pages only while this share of the pool stays free after its first call:
# the room turns already stored need to grow. Without it, new turns fill the pool and every
# turn then fails to grow at once.
GROWTH_RESERVE = 0.125


def within_table(end: int) -> bool:
    """Whether a row's page table reaches position ``end`` (frames from the start of the prompt)."""
    return -(-end // PAGE_FRAMES) <= TABLE_PAGES


# (query [rows * queries, heads, dim], key pages, value pages, plan, softmax scale) -> output like query
PagedAttention = Callable[[Tensor, Tensor, Tensor, ChunkSequences, float], Tensor]


@dataclass
class TurnState:
    """One turn's share of the pool: its own pages (positions from the page its voice prefix
    ends in, in order), its conv-context slot, and how many frames after the voice prefix
    are committed (their state is final). A turn that ``fell_back`` holds nothing and goes on
    by recompute, until the pool has room for it again (``TurnStatePool.has_room``)."""

    slot: int
    pages: list[int] = field(default_factory=list)
    frames: int = 0
    fell_back: bool = False


@dataclass(frozen=True)
class TurnRows:
    """Where each row of a call stands in the bank and the pool (B rows; what a CUDA graph of a
    paged call takes as static inputs besides the decoder's).

    slots ``[B]``: the voice prefix's bank slot; page_table ``[B, TABLE_PAGES]``: the logical
    page of each 16-frame span of the row's positions (scratch past its own); stored ``[B]``:
    frames committed after the prefix (the call starts there); turn_slot ``[B]``: its
    conv-context slot (scratch for a padding row); commit ``[B]``: new frames this call
    commits (whole chunks).
    """

    slots: Tensor
    page_table: Tensor
    stored: Tensor
    turn_slot: Tensor
    commit: Tensor

    def as_tuple(self) -> tuple[Tensor, ...]:
        return self.slots, self.page_table, self.stored, self.turn_slot, self.commit


class TurnStatePool:
    """Decoder state of turns in flight and of the voice prefixes they continue (see the module).

    ``inputs[layer]``: ``[steps * 2 * (pages + 1), 16, 1, dim]``; ``conv_context[conv]``:
    ``[steps, turn_slots + 1, 2, channels, kernel - 1]``. The last
    logical page and the last slot are scratch. ``attend``: the paged attention
    (paged_varlen.flash_attend on a GPU; the reference by default). Thread-safe bookkeeping:
    turns grow on the token2wav thread and are released from others.
    """

    def __init__(
        self, cfm: CFM, pages: int, like: Tensor, steps: int = N_TIMESTEPS, attend: PagedAttention = attend_reference,
    ) -> None:
        if pages < 1:
            raise ValueError(f"a turn-state pool needs >= 1 page, got {pages}")
        self.steps = steps
        self.pages = pages
        self.page_frames = PAGE_FRAMES
        self.chunk = cfm.config.estimator.static_chunk_size
        self.scratch = pages  # the logical scratch page, and the scratch turn slot's index below
        self.turn_slots = max(1, pages // PAGES_PER_TURN_SLOT)
        self.slot_scratch = self.turn_slots
        self.attend = attend
        # Paged calls attend over layer inputs: fold each attention layer's carries into its
        # projections (SelfAttention.fold_input_attention). Here, because every paged call
        # (eager, or a flow graph captured over this pool) needs a pool, which is built once
        # the weights are loaded and in their dtype, and before any graph is captured. Folding
        # is explicit rather than on first use: a first use may be inside a graph capture.
        cfm.estimator.fold_input_attention()
        physical = steps * 2 * (pages + 1)
        self.inputs = [like.new_zeros(physical, PAGE_FRAMES, 1, layer.dim) for layer in cfm.estimator.attention_layers]
        self.conv_context = [
            like.new_zeros(steps, self.turn_slots + 1, 2, conv.in_channels, conv.context)
            for conv in cfm.estimator.causal_convs
        ]
        self._lock = threading.Lock()
        self._free_pages = list(range(pages - 1, -1, -1))
        self._free_slots = list(range(self.turn_slots - 1, -1, -1))
        # Bank slot -> (the bank, its generation of that slot, the prefix's pages).
        self._prefixes: dict[int, tuple[PrefixBank, int, list[int]]] = {}
        # Running totals (the engine exports them): the most pages held by turns at once, pages
        # and turns given state (a turn that came back counts again), turns that fell back to
        # the recompute path (each time), and returns of those to the pool.
        self.peak_pages = 0
        self.pages_stored = 0
        self.turns = 0
        self.fallbacks = 0
        self.returns = 0

    @staticmethod
    def page_bytes(cfm: CFM, dtype: torch.dtype, steps: int = N_TIMESTEPS) -> int:
        """Bytes of one logical page (and its share of a turn slot) at this size, dtype and step count."""
        attention = sum(layer.dim * PAGE_FRAMES for layer in cfm.estimator.attention_layers)
        conv = sum(conv.in_channels * conv.context for conv in cfm.estimator.causal_convs)
        per_page = steps * 2 * (attention * PAGES_PER_TURN_SLOT + conv) * torch.empty(0, dtype=dtype).element_size()
        return per_page // PAGES_PER_TURN_SLOT

    @classmethod
    def within(
        cls, cfm: CFM, budget_bytes: int, like: Tensor, steps: int = N_TIMESTEPS,
        attend: PagedAttention = attend_reference,
    ) -> TurnStatePool:
        """The largest pool (plus its scratch page) that fits ``budget_bytes``."""
        pages = budget_bytes // cls.page_bytes(cfm, like.dtype, steps) - 1
        if pages < 1:
            raise ValueError(f"a budget of {budget_bytes / 2**30:.2f} GiB holds no page of decoder state")
        return cls(cfm, pages, like, steps, attend)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.inputs, *self.conv_context))

    def totals(self) -> dict[str, float]:
        """The pool's running totals, in bytes where they are memory (see ``__init__``)."""
        page = self.nbytes / (self.pages + 1)
        with self._lock:
            return {
                "peak_bytes": self.peak_pages * page, "stored_bytes": self.pages_stored * page,
                "turns": self.turns, "fallbacks": self.fallbacks, "returns": self.returns,
            }

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """The running totals as they were before, whatever turns come and go inside (a check's)."""
        with self._lock:
            saved = self.peak_pages, self.pages_stored, self.turns, self.fallbacks, self.returns
        try:
            yield
        finally:
            with self._lock:
                self.peak_pages, self.pages_stored, self.turns, self.fallbacks, self.returns = saved

    @property
    def pages_in_use(self) -> int:
        """Pages held by turns (voice prefixes' pages aside)."""
        with self._lock:
            return self._turn_pages()

    def _turn_pages(self) -> int:
        return self.pages - len(self._free_pages) - sum(len(p) for _, _, p in self._prefixes.values())

    # ------------------------------------------------------------------ pages

    def _take(self, count: int) -> list[int] | None:
        if len(self._free_pages) < count:
            return None
        return [self._free_pages.pop() for _ in range(count)]

    def grow(self, turn: TurnState | None, pages: int) -> TurnState | None:
        """``turn`` (a new one when None) with ``pages`` more pages, or None when the pool has
        too few free (then nothing is taken); a new turn also leaves GROWTH_RESERVE of the
        pool free."""
        with self._lock:
            if turn is None and not self._admits(pages):
                return None
            taken = self._take(pages)
            if taken is None:
                return None
            if turn is None:
                turn = TurnState(self._free_slots.pop())
                self.turns += 1
            turn.pages += taken
            self.pages_stored += pages
            self.peak_pages = max(self.peak_pages, self._turn_pages())
            return turn

    def has_room(self, prefix_frames: int, end: int) -> bool:
        """Whether a turn would be admitted now to reach position ``end`` (frames from the start
        of the prompt) after a voice prefix of ``prefix_frames``: within the page table, with
        GROWTH_RESERVE of the pool kept free after it. Nothing is taken (its call grows it)."""
        if not within_table(end):
            return False
        with self._lock:
            return self._admits(self.pages_between(prefix_frames, end))

    def count_return(self) -> None:
        """A turn that fell back came back (the engine exports the count)."""
        with self._lock:
            self.returns += 1

    def _admits(self, pages: int) -> bool:
        return bool(self._free_slots) and len(self._free_pages) - pages >= GROWTH_RESERVE * self.pages

    @staticmethod
    def pages_between(prefix_frames: int, end: int) -> int:
        """Pages a turn needs to reach position ``end`` after a voice prefix of ``prefix_frames``:
        its own start on the page the prefix ends in."""
        return -(-end // PAGE_FRAMES) - prefix_frames // PAGE_FRAMES

    def release(self, turn: TurnState) -> None:
        """Give a turn's pages and slot back (it ended, or was cancelled); again is a no-op."""
        with self._lock:
            self._free_pages += turn.pages
            if turn.slot >= 0:
                self._free_slots.append(turn.slot)
            turn.pages, turn.frames, turn.slot = [], 0, -1

    def fall_back(self, turn: TurnState | None) -> TurnState:
        """``turn`` (None: one that never had state) going on by recompute: what it held given
        back, and the fallback counted (the engine exports the count)."""
        if turn is None:
            turn = TurnState(-1)
        self.release(turn)
        turn.fell_back = True
        with self._lock:
            self.fallbacks += 1
        return turn

    def prefix_pages(self, bank: PrefixBank, slot: int) -> list[int] | None:
        """The pages holding bank slot ``slot``'s voice prefix, copied from the bank when the
        slot's prefix is new to the pool; None when the pool has no room for it."""
        held = self._prefixes.get(slot)
        if held is not None and held[0] is bank and held[1] == bank.generation[slot]:
            return held[2]
        frames = bank.start_frames[slot]
        with self._lock:
            # Copies of prefixes the bank no longer holds (this slot's old one, another bank's).
            for stale in [s for s, (b, g, _) in self._prefixes.items() if b is not bank or g != bank.generation[s]]:
                self._free_pages += self._prefixes.pop(stale)[2]
            pages = self._take(-(-frames // PAGE_FRAMES))
            if pages is None:
                return None
            self._prefixes[slot] = (bank, bank.generation[slot], pages)
        index = to_device(pages, torch.long, bank.start.device)
        for ours, stored in zip(self.inputs, bank.inputs, strict=True):
            # [steps, 2, frames, dim] -> pages of [16, 1, dim] per step and row
            prefix = torch.nn.functional.pad(stored[:, slot, :, :frames], (0, 0, 0, len(pages) * PAGE_FRAMES - frames))
            pages_of = prefix.reshape(*prefix.shape[:2], len(pages), PAGE_FRAMES, *ours.shape[2:])
            self._logical(ours)[:, :, index] = pages_of
        return pages

    def _logical(self, stored: Tensor) -> Tensor:
        """A pool tensor as ``[steps, 2, pages + 1, 16, 1, dim]``."""
        return stored.view(self.steps, 2, self.pages + 1, *stored.shape[1:])

    def copy_page(self, source: int, target: int) -> None:
        """Logical page ``source`` into ``target``, every layer, step and row."""
        for stored in self.inputs:
            logical = self._logical(stored)
            logical[:, :, target] = logical[:, :, source]


class PagedView(PrefixView):
    """One Euler step of a call whose rows start after their voice prefix and stored frames:
    every attention layer's new inputs go into the rows' pages (``input_store``: written by the
    norm that makes them, one kernel with the fused kernels on), then it attends
    over the pages (one varlen call, see paged_varlen.py); the conv context comes from
    the turn's slot (the bank's for a turn with nothing stored) and the context at the commit
    boundary goes back to it."""

    keeps_inputs = True

    def __init__(self, bank: PrefixBank, pool: TurnStatePool, rows: TurnRows, mask: Tensor) -> None:
        if bank.steps != pool.steps:
            raise ValueError(f"a bank of {bank.steps} Euler steps with a pool of {pool.steps}")
        super().__init__(bank, rows.slots)
        self.pool = pool
        stored = rows.stored.repeat(2)
        commit = rows.commit.repeat(2)
        read_slot = rows.turn_slot.repeat(2)
        write_slot = torch.where(commit > 0, read_slot, pool.slot_scratch)
        self.context_rows = ContextRows(stored, commit, read_slot, write_slot, self.slot_of_row, self.branch)
        self.start = self.start + stored
        device = mask.device
        frames = mask.shape[2]
        new_frames = mask[:, 0].sum(dim=1, dtype=torch.long).repeat(2)
        # Logical page p of CFG row r at step 0 is physical page r * (pages + 1) + p.
        table = rows.page_table.repeat(2, 1) + self.branch[:, None] * (pool.pages + 1)
        positions = self.start[:, None] + torch.arange(frames, device=device)
        column = (positions // PAGE_FRAMES).clamp(max=table.shape[1] - 1)
        page = torch.where(
            torch.arange(frames, device=device) < new_frames[:, None],
            table.gather(1, column), pool.scratch + self.branch[:, None] * (pool.pages + 1),
        )
        self._write0 = (page * PAGE_FRAMES + positions % PAGE_FRAMES).reshape(-1)
        self._plan0 = chunk_sequences(table, self.start, new_frames, frames, pool.chunk, PAGE_FRAMES)
        self._write, self._plan = self._write0, self._plan0

    def at_step(self, step: int | Tensor) -> PagedView:
        super().at_step(step)
        offset = step * 2 * (self.pool.pages + 1)  # physical pages of one Euler step
        if isinstance(offset, Tensor):
            offset = offset.to(torch.int32)
        self._write = self._write0 + offset * PAGE_FRAMES
        self._plan = replace(self._plan0, block_table=self._plan0.block_table + offset)
        return self

    def attention_mask(self, new_frames: Tensor, positions: Tensor, chunk: int) -> None:
        return None  # the plan's pieces are the chunk rule

    def input_store(self, slot: int) -> tuple[Tensor, Tensor]:
        pages = self.pool.inputs[slot]
        return pages.view(-1, pages.shape[-1]), self._write

    def attend_inputs(self, slot: int, query: Tensor, scale: float) -> Tensor:
        rows, frames, heads, dim = query.shape
        pages = self.pool.inputs[slot]
        out = self.pool.attend(query.reshape(-1, heads, dim), pages, pages, self._plan, scale)
        return out.view(rows, frames, heads, dim)

    def conv_input(self, slot: int, x: Tensor) -> Tensor:
        # One Triton kernel on the GPU with the flow's fused kernels on (fused_context.py).
        return conv_input(x, self.pool.conv_context[slot], self.bank.conv_context[slot], self.step, self.context_rows)


def pad_turn_rows(rows: TurnRows, pool: TurnStatePool, batch: int) -> TurnRows:
    """``rows`` padded to a graph's ``batch`` rows: padding rows take row 0's prefix slot and
    start, but every page, and their conv slot, is scratch, so they keep nothing and overwrite
    no row's state."""
    extra = batch - len(rows.slots)

    def padded(index: Tensor, fill: int | None) -> Tensor:
        shape = (extra, *index.shape[1:])
        tail = index[:1].expand(shape) if fill is None else index.new_full(shape, fill)
        return torch.cat([index, tail])

    return TurnRows(
        padded(rows.slots, None), padded(rows.page_table, pool.scratch), padded(rows.stored, None),
        padded(rows.turn_slot, pool.slot_scratch), padded(rows.commit, 0),
    )


def paged_noise(cfm: CFM, bank: PrefixBank, rows: TurnRows, frames: int) -> Tensor:
    """The fixed noise of ``frames`` frames from each row's start (after its prefix and stored frames)."""
    start = bank.start[rows.slots] + rows.stored
    widest = rows.page_table.shape[1] * PAGE_FRAMES + frames
    noise = cfm.noise[:, :, :widest].expand(len(start), -1, -1)
    return gather_frames(noise, start, frames)


def solve_paged(
    cfm: CFM, bank: PrefixBank, pool: TurnStatePool, rows: TurnRows, mu: Tensor, mask: Tensor, spks: Tensor,
    cond: Tensor,
) -> Tensor:
    """Streaming-mode mel of each row's frames after its voice prefix and stored frames (row b's
    column i is frame ``bank.start[slots[b]] + stored[b] + i``), writing their state to the
    rows' pages. Equals the same frames of a whole streaming solve."""
    view = PagedView(bank, pool, rows, mask)
    noise = paged_noise(cfm, bank, rows, mu.shape[2]).to(mu.dtype)
    return cfm.solve(noise, mask, mu, spks, cond, True, pool.steps, view.at_step)


# (rows, mu, mask, spks, cond) -> the mel of a paged call (solve_paged, or a CUDA graph's replay)
SolvePaged = Callable[[TurnRows, Tensor, Tensor, Tensor, Tensor], Tensor]
# The rows' start frames (on the host) -> their decoder inputs for the frames from start[b] on
# (Flow.inputs_after of the turns' kept encoder output, or Flow.decoder_inputs of their tokens
# encoded whole), and the frame each row ends at, on the host
InputsFrom = Callable[[list[int]], tuple[DecoderInputs, list[int]]]


def turn_rows(
    bank: PrefixBank, pool: TurnStatePool, slots: list[int], turns: list[TurnState | None], end: list[int],
    commit: list[int],
) -> tuple[TurnRows | None, list[TurnState | None], list[bool]]:
    """The rows of a paged call whose row b ends at position ``end[b]`` (its turn's pages grown
    to cover it; a new turn's first page copied from its prefix's last), and which rows it
    serves: a row whose turn fell back, or whose pages cannot be had (its turn then falls
    back), is not served. ``commit``: frames each row commits."""
    turns = list(turns)
    served = [False] * len(slots)
    table = np.full((len(slots), TABLE_PAGES), pool.scratch, dtype=np.int64)
    prefix_frames = bank.start_frames
    for b, (slot, turn) in enumerate(zip(slots, turns)):
        if turn is not None and turn.fell_back:
            continue
        prefix = prefix_frames[slot]
        prefix_pages = pool.prefix_pages(bank, slot)
        first = prefix // PAGE_FRAMES  # the page the prefix ends in: the turn's own from here
        need = pool.pages_between(prefix, end[b])
        grown = None
        if prefix_pages is not None and within_table(end[b]):
            have = len(turn.pages) if turn is not None else 0
            grown = pool.grow(turn, max(0, need - have))
        if grown is None:
            turns[b] = pool.fall_back(turn)
            continue
        if turn is None and prefix % PAGE_FRAMES and grown.pages:
            pool.copy_page(prefix_pages[first], grown.pages[0])
        turns[b] = grown
        served[b] = True
        table[b, :first] = prefix_pages[:first]
        table[b, first : first + len(grown.pages)] = grown.pages
    rows = [b for b in range(len(slots)) if served[b]]
    if not rows:
        return None, turns, served
    device = bank.start.device

    def column(values: list[int]) -> Tensor:
        return to_device([values[b] for b in rows], torch.long, device)

    return TurnRows(
        column(slots), to_device(table[rows], None, device), column([t and t.frames for t in turns]),
        column([t and t.slot for t in turns]), column(commit),
    ), turns, served


@dataclass(frozen=True)
class PagedResult:
    """A paged call's decoder mel ``[B', 80, width]`` for the rows it served (``served``, B'
    of them): row b's column i is frame start[b] + i, up to end[b] (frames counted from the
    start of the prompt); ``start`` and ``end`` cover every row, counted on the host."""

    mel: Tensor | None
    start: list[int]
    end: list[int]
    served: list[bool]


@torch.inference_mode()
def flow_paged(
    flow: Flow, bank: PrefixBank, pool: TurnStatePool, slots: list[int], turns: list[TurnState | None],
    inputs_from: InputsFrom, keep: list[bool], solve: SolvePaged | None = None,
) -> tuple[PagedResult, list[TurnState | None]]:
    """A streaming flow call of these rows that starts each row after its voice prefix (bank
    slot ``slots[b]``) and its turn's stored frames (``turns[b]``, None: none yet), and commits
    the whole chunks it completes for the rows that ``keep`` state (not on the last chunk:
    nothing follows it). ``inputs_from``: the rows' decoder inputs from those start frames on
    (a turn's last chunk, with finalize, may share the call with other turns' later ones).
    Returns the mel of the rows it served and the turns (a row not served fell back: run it on
    the recompute path).

    ``solve``: the decoder (default :func:`solve_paged`, eager; the paged flow passes a graph's
    replay, paged_flow.py). Positions are counted on the host: the call waits for the GPU
    nowhere (``inputs_from`` as the paged flow gives it neither).
    """
    chunk = pool.chunk
    starts = [bank.start_frames[slot] + (t.frames if t is not None else 0) for slot, t in zip(slots, turns)]
    inputs, ends = inputs_from(starts)
    commit = [(e // chunk * chunk - s) if k else 0 for s, e, k in zip(starts, ends, keep)]
    given = list(turns)
    rows, turns, served = turn_rows(bank, pool, slots, turns, ends, commit)
    if rows is None:
        return PagedResult(None, starts, ends, served), turns
    rows_served = [b for b, s in enumerate(served) if s]
    index = to_device(rows_served, torch.long, bank.start.device)
    width = max(ends[b] - starts[b] for b in rows_served)  # rows not served may be wider
    if solve is None:
        def solve(rows, mu, mask, spks, cond):
            return solve_paged(flow.decoder, bank, pool, rows, mu, mask, spks, cond)
    try:
        mel = solve(
            rows, inputs.mu[index, :, :width], inputs.mask[index, :, :width], inputs.spk[index],
            inputs.cond[index, :, :width],
        )
    except BaseException:  # the turns this call made are in no one's hands yet
        for before, after in zip(given, turns):
            if before is None and after is not None:
                pool.release(after)
        raise
    for b, count in enumerate(commit):
        if served[b]:
            turns[b].frames += count
    return PagedResult(mel, starts, ends, served), turns
