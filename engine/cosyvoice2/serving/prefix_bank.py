"""Voice prefixes: the decoder state of a voice's prompt, computed once and shared by every
streaming call in that voice.

The prompt's complete 50-frame chunks (those whose tokens and look-ahead are all prompt
tokens) come out of every streaming flow call the same (chunk-causality, see
engine/cosyvoice2/model/flow.py). A batch of streaming rows may therefore start its decoder
after each row's voice prefix, reading the prefix's keys, values and conv context from a
:class:`PrefixBank` instead of recomputing them: the same mel for less work. The bank holds
the most recently used voices in fixed slots, in tensors that CUDA graphs read in place
(flow_graphs.py), so voices can come and go between replays.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model.cfm import CFM, N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.model.estimator import attend_over_stored, chunk_attention_mask
from tts_gateway.engine.cosyvoice2.model.flow import Flow, gather_frames
from tts_gateway.engine.cosyvoice2.model.flow_encoder import encode_tokens
from tts_gateway.engine.cosyvoice2.serving.incremental import CFMStreamCache, forward_chunk, zero_conv_context
from tts_gateway.engine.cosyvoice2.serving.request import VoicePrompt

# (bank slots [B], mu, mask, spks, cond) -> mel of the frames after the rows' voice prefixes
SolveAfterPrefix = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class VoicePrefix:
    """The decoder's state after a voice's prompt: what every utterance in that voice shares.

    The prompt's complete 50-frame chunks (those whose tokens and look-ahead are all
    prompt tokens) come out of every streaming flow call the same: same tokens, same
    prompt mel, same x-vector, same noise, and chunk-causal attention keeps them blind to
    what follows. So a streaming call may start its decoder after them, attending to
    their stored keys/values. Layout as ``incremental.CFMStreamCache`` with two rows (conditioned,
    unconditioned): ``keys[step * n_attention + layer]`` ``[2, heads, frames, head_dim]``,
    ``conv_context[step * n_conv + conv]`` ``[2, channels, kernel - 1]``, for each of ``steps``
    Euler steps (a prefix serves only solves of as many steps). ``inputs``, when kept: each
    attention layer's input ``[2, frames, dim]``, as ``keys`` (what a turn-state pool stores,
    turn_pool.py).
    """

    steps: int
    frames: int
    keys: list[Tensor]
    values: list[Tensor]
    conv_context: list[Tensor]
    inputs: list[Tensor] | None = None


class PrefixBank:
    """Voice prefixes in fixed tensors, one slot per voice: what batched calls read.

    ``keys[layer]`` is ``[steps, slots, 2, heads, frames, head_dim]`` (Euler step, slot, then
    the prefix's two rows), zero past a slot's own prefix; ``conv_context[conv]`` likewise
    ``[steps, slots, 2, channels, kernel - 1]``; ``start[slot]`` is the slot's prefix length
    (0 while empty). The step is an index, not a list position, so that one CUDA graph of an
    Euler step reads every step's state (flow_graphs). ``put`` writes in place, so such a graph
    stays valid as voices come and go. ``steps``: the Euler steps of the solves after its
    prefixes, and of the prefixes it holds. With ``keep_inputs``, ``inputs[layer]`` ``[steps,
    slots, 2, frames, dim]`` holds the prefixes' attention-layer inputs too (for a turn-state
    pool; empty otherwise).
    """

    def __init__(
        self, cfm: CFM, slots: int, frames: int, like: Tensor, steps: int = N_TIMESTEPS, keep_inputs: bool = False,
    ) -> None:
        if slots < 1 or frames < 0:
            raise ValueError(f"a prefix bank needs >= 1 slot and >= 0 frames, got {slots}, {frames}")
        self.steps = steps
        self.slots = slots
        self.frames = frames
        self.n_attention = len(cfm.estimator.attention_layers)
        self.n_conv = len(cfm.estimator.causal_convs)
        self.keys = [
            like.new_zeros(steps, slots, 2, layer.heads, frames, layer.head_dim)
            for layer in cfm.estimator.attention_layers
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.inputs = [
            like.new_zeros(steps, slots, 2, frames, layer.dim) for layer in cfm.estimator.attention_layers
        ] if keep_inputs else []
        self.conv_context = [
            like.new_zeros(steps, slots, 2, conv.in_channels, conv.context) for conv in cfm.estimator.causal_convs
        ]
        self.start = torch.zeros(slots, dtype=torch.long, device=like.device)
        self.start_frames = [0] * slots  # ``start`` on the host: reading it needs no wait for the GPU
        self.generation = [0] * slots  # how often each slot was written (copies of it go stale)

    def put(self, slot: int, prefix: VoicePrefix) -> None:
        if prefix.steps != self.steps:
            raise ValueError(f"a prefix of {prefix.steps} Euler steps does not fit a bank of {self.steps}")
        if prefix.frames > self.frames:
            raise ValueError(f"a prefix of {prefix.frames} frames does not fit a bank of {self.frames}")
        if self.inputs and prefix.inputs is None:
            raise ValueError("a bank that keeps layer inputs needs a prefix that kept them")
        for index, (keys, values) in enumerate(zip(prefix.keys, prefix.values)):
            step, layer = divmod(index, self.n_attention)
            for bank, part in ((self.keys, keys), (self.values, values)):
                bank[layer][step, slot].zero_()
                bank[layer][step, slot, :, :, : prefix.frames] = part
            if self.inputs:
                self.inputs[layer][step, slot].zero_()
                self.inputs[layer][step, slot, :, : prefix.frames] = prefix.inputs[index]
        for index, part in enumerate(prefix.conv_context):
            step, conv = divmod(index, self.n_conv)
            self.conv_context[conv][step, slot] = part
        self.start[slot] = prefix.frames
        self.start_frames[slot] = prefix.frames
        self.generation[slot] += 1

    @property
    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, *self.inputs, *self.conv_context)
        return sum(t.numel() * t.element_size() for t in tensors)


class PrefixView:
    """One Euler step of a batch whose rows start after their voices' prefixes (read-only).

    ``slots[r]``: the bank slot of row r's voice (rows are sessions; CFG doubles them, the
    conditioned half first, as in ``CFM.solve``). Every shape depends on the bank and the
    batch only, not on the values, and the step may be a device tensor, so one CUDA graph
    can hold this view for every step.
    """

    keeps_inputs = False

    def __init__(self, bank: PrefixBank, slots: Tensor) -> None:
        self.bank = bank
        self.step: int | Tensor = 0
        self.slot_of_row = slots.repeat(2)
        self.start = bank.start[self.slot_of_row]
        # Row i of the 2B-row batch takes row `branch[i]` (0 conditioned, 1 not) of its slot.
        self.branch = torch.arange(2, device=slots.device).repeat_interleave(len(slots))

    def at_step(self, step: int | Tensor) -> PrefixView:
        """This view for Euler step ``step``: an int, or a one-element device tensor."""
        self.step = step
        return self

    def _rows(self, stored: Tensor) -> Tensor:
        """Each batch row's part of a bank tensor at this step."""
        step = self.step if isinstance(self.step, int) else self.step.expand(len(self.slot_of_row))
        return stored[step, self.slot_of_row, self.branch]

    def attention_mask(self, new_frames: Tensor, positions: Tensor, chunk: int) -> Tensor:
        """Queries: the new frames, at start + i. Keys: the bank's frames (j, valid below the
        row's own prefix length), then the new frames."""
        start = self.start
        prefix_pos = torch.arange(self.bank.frames, device=positions.device)
        key_pos = torch.cat([prefix_pos.expand(len(start), -1), start[:, None] + positions], dim=1)
        key_valid = torch.cat([prefix_pos < start[:, None], positions < new_frames[:, None]], dim=1)
        return chunk_attention_mask(key_valid, start[:, None] + positions, chunk, key_pos)

    def attend(self, slot: int, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> Tensor:
        return attend_over_stored(self, slot, query, key, value, mask)

    def keys_values(self, slot: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = self.bank.keys[slot], self.bank.values[slot]
        return torch.cat([self._rows(keys), key], dim=2), torch.cat([self._rows(values), value], dim=2)

    def conv_input(self, slot: int, x: Tensor) -> Tensor:
        return torch.cat([self._rows(self.bank.conv_context[slot]), x], dim=2)


def decoder_prefix(
    cfm: CFM, mu: Tensor, spks: Tensor, cond: Tensor, frames: int, steps: int = N_TIMESTEPS,
    keep_inputs: bool = False,
) -> VoicePrefix:
    """The decoder state after the first ``frames`` frames (whole chunks) of one voice, at each
    of ``steps`` Euler steps (with ``keep_inputs``, its attention layers' inputs too).

    mu, cond: ``[1, 80, >= frames]`` for the voice's prompt frames; spks ``[1, 80]``.
    """
    chunk = cfm.config.estimator.static_chunk_size
    if chunk <= 0 or frames % chunk or frames > mu.shape[2]:
        raise ValueError(f"a voice prefix is whole {chunk}-frame chunks within the prompt, got {frames}")
    if frames == 0:  # nothing shared: no keys, and the zero left context of a causal conv
        layers = cfm.estimator.attention_layers * steps
        return VoicePrefix(
            steps=steps,
            frames=0,
            keys=[mu.new_zeros(2, layer.heads, 0, layer.head_dim) for layer in layers],
            values=[mu.new_zeros(2, layer.heads, 0, layer.head_dim) for layer in layers],
            conv_context=zero_conv_context(cfm, 2, mu, steps),
            inputs=[mu.new_zeros(2, 0, layer.dim) for layer in layers] if keep_inputs else None,
        )
    cache = CFMStreamCache(steps)
    mask = mu.new_ones(1, 1, frames)
    noise = cfm.noise[:, :, :frames]
    with recorded_inputs(cfm, keep_inputs) as inputs:
        forward_chunk(cfm, cache, mu[:, :, :frames], mask, spks, cond[:, :, :frames], noise, [0], [frames])
    if keep_inputs and len(inputs) != len(cache.keys):
        raise RuntimeError(f"recorded {len(inputs)} attention inputs for {len(cache.keys)} layer steps")
    return VoicePrefix(
        steps=steps,
        frames=frames,
        keys=[k[:, :, :frames].clone() for k in cache.keys],
        values=[v[:, :, :frames].clone() for v in cache.values],
        conv_context=cache.conv_context,
        inputs=inputs if keep_inputs else None,
    )


@contextlib.contextmanager
def recorded_inputs(cfm: CFM, record: bool) -> Iterator[list[Tensor]]:
    """The inputs of the estimator's attention layers while the ``with`` block runs, in call
    order (one solve: ``[step * n_attention + layer]``), when ``record``; the module itself only
    computes, so they are read by forward pre-hooks. Only this thread's calls are recorded: the
    first-chunk lane may run the same modules meanwhile."""
    inputs: list[Tensor] = []
    owner = threading.get_ident()

    def record_input(_: nn.Module, args: tuple) -> None:
        if threading.get_ident() == owner:
            inputs.append(args[0].clone())

    layers = cfm.estimator.attention_layers if record else []
    hooks = [layer.register_forward_pre_hook(record_input) for layer in layers]
    try:
        yield inputs
    finally:
        for hook in hooks:
            hook.remove()


@torch.inference_mode()
def voice_prefix(
    flow: Flow, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, steps: int = N_TIMESTEPS,
    keep_inputs: bool = False,
) -> VoicePrefix:
    """The decoder state every streaming call of this voice shares (see :class:`VoicePrefix`):
    the prompt's whole chunks whose tokens and look-ahead are all prompt tokens (none
    when the prompt is shorter than one such chunk), for solves of ``steps`` Euler steps.

    prompt_token ``[1, P]``, prompt_feat ``[1, 2P, 80]``, embedding ``[1, 192]``.
    """
    config = flow.config
    length = torch.tensor([prompt_token.shape[1]], device=prompt_token.device)
    mu, _, spk = encode_tokens(
        flow, prompt_token, length, prompt_token[:, :0], torch.zeros_like(length), embedding, True, False,
        config.pre_lookahead_len, config.token_mel_ratio,
    )
    frames = flow.voice_prefix_frames(prompt_token.shape[1])
    feat_len = torch.tensor([prompt_feat.shape[1]], device=mu.device)
    cond = flow.prompt_condition(prompt_feat, feat_len, torch.zeros_like(feat_len), frames)
    return decoder_prefix(flow.decoder, mu, spk, cond, frames, steps, keep_inputs)


def noise_after(cfm: CFM, bank: PrefixBank, slots: Tensor, frames: int) -> Tensor:
    """The fixed noise of ``frames`` frames after each row's voice prefix: ``[B, 80, frames]``."""
    noise = cfm.noise[:, :, : bank.frames + frames].expand(len(slots), -1, -1)
    return gather_frames(noise, bank.start[slots], frames)


def solve_after_prefix(
    cfm: CFM, bank: PrefixBank, slots: Tensor, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor
) -> Tensor:
    """Streaming-mode mel of the frames after each row's voice prefix.

    Row b's voice prefix is in ``bank`` slot ``slots[b]``, and its column i is frame
    ``bank.start[slots[b]] + i``: mu, cond ``[B, 80, n]``, mask ``[B, 1, n]``. Equals the
    same frames of a whole streaming solve of the bank's Euler steps (the prefix frames'
    states are the stored ones), with the fixed noise. What a CUDA graph after voice
    prefixes captures (flow_graphs.py)."""
    view = PrefixView(bank, slots)
    noise = noise_after(cfm, bank, slots, mu.shape[2]).to(mu.dtype)
    return cfm.solve(noise, mask, mu, spks, cond, True, bank.steps, view.at_step)


@torch.inference_mode()
def flow_after_prefix(
    flow: Flow,
    bank: PrefixBank,
    slots: Tensor,
    token: Tensor,
    token_len: Tensor,
    prompt_token: Tensor,
    prompt_token_len: Tensor,
    prompt_feat: Tensor,
    prompt_feat_len: Tensor,
    embedding: Tensor,
    streaming: bool = True,
    finalize: bool = False,
    solve: SolveAfterPrefix | None = None,
    encoding: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``Flow.inference_batch`` of streaming rows, the decoder started after each row's voice
    prefix (row b's in ``bank`` slot ``slots[b]``): the same mel for less work.

    ``solve`` runs the decoder after the prefixes (default: :func:`solve_after_prefix`, eager;
    the runner passes a CUDA graph's replay); ``encoding``: the token encoder's output where
    the caller computed it (``Flow.decoder_inputs``). Returns mel ``[B, 80, max new frames]``
    and the new frame counts ``[B]``.
    """
    inputs = flow.decoder_inputs(
        token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len, embedding, streaming,
        finalize, start=bank.start[slots], encoding=encoding,
    )
    if solve is None:
        def solve(slots, mu, mask, spks, cond):
            return solve_after_prefix(flow.decoder, bank, slots, mu, mask, spks, cond)
    mel = solve(slots, inputs.mu, inputs.mask, inputs.spk, inputs.cond)
    return flow.new_frames(mel, inputs), inputs.new_len


class VoicePrefixCache:
    """Which voices' prefixes the bank holds: ``capacity`` slots, the least recently used
    voice's slot taken for a new one (its prefix built on first use).

    The bank is as wide as the widest prefix it was made for. CUDA graphs read the bank in
    place, so once :meth:`prepare` has fixed its width (before graphs are captured) it is
    never rebuilt; a voice whose prefix is wider then runs without one. Prefixes and bank
    are laid out for solves of ``steps`` Euler steps; ``keep_inputs``: with their attention
    layers' inputs (for a turn-state pool).

    One thread (the engine thread) takes slots and builds prefixes. A second thread (the
    first-chunk lane) may read voices whose prefixes are written already: it pins them for a
    call (:meth:`pin`), and a pinned slot goes to no other voice until :meth:`unpin` (once the
    call's GPU work is done). A prefix is built outside the lock, so a pin never waits for a
    build; a voice enters the cache once its prefix is written.
    """

    def __init__(self, flow: Flow, capacity: int, steps: int = N_TIMESTEPS, keep_inputs: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"a voice-prefix cache needs >= 1 slot, got {capacity}")
        self.flow = flow
        self.capacity = capacity
        self.steps = steps
        self.keep_inputs = keep_inputs
        self.bank: PrefixBank | None = None
        self._fixed = False
        # Voice -> its slot, most recently used last (the prompt too: its id stays its own while held).
        self._slots: OrderedDict[int, tuple[VoicePrompt, int]] = OrderedDict()
        self._pins: Counter[int] = Counter()  # slot -> calls of the other thread reading it
        self._written: dict[int, torch.cuda.Event] = {}  # slot -> its prefix's write, on the building stream
        self._lock = threading.Lock()
        self._unpinned = threading.Condition(self._lock)
        self._waiting = False  # the engine thread waits for pins to go: no new ones meanwhile

    def prepare(self, prompts: list[VoicePrompt], widest_prompt_tokens: int) -> PrefixBank:
        """At start-up: a bank as wide as the prefix of a prompt of ``widest_prompt_tokens``
        (the longest of the registered voices), holding the first voices' prefixes; its
        width is fixed from here on."""
        self.make_room(self.flow.voice_prefix_frames(widest_prompt_tokens), next(self.flow.parameters()))
        self._fixed = True
        self.slots(prompts[: self.capacity])
        return self.bank

    @property
    def fixed(self) -> bool:
        """Whether the bank's width is fixed (``prepare``): it is never replaced."""
        return self._fixed

    def make_room(self, frames: int, like: Tensor) -> None:
        """A bank at least ``frames`` wide, unless its width is fixed (``prepare``)."""
        with self._lock:
            if self.bank is None or (frames > self.bank.frames and not self._fixed):
                if self._pins:
                    raise RuntimeError("the voice-prefix bank cannot be replaced while another thread reads it")
                self.bank = PrefixBank(self.flow.decoder, self.capacity, frames, like, self.steps, self.keep_inputs)
                self._slots.clear()
                self._written.clear()

    def slot(self, prompt: VoicePrompt) -> int | None:
        """The voice's slot in the bank (``slots`` of one voice)."""
        taken = self.slots([prompt])
        return None if taken is None else taken[0]

    def slots(self, prompts: list[VoicePrompt]) -> list[int] | None:
        """Each voice's slot in the bank, a new voice's prefix built on first use in place of the
        least recently used voice's that is not one of these; None, taking no slot, when a
        prefix is wider than the bank or the call has more voices than slots. A pinned slot is
        waited for where only pins stand in the way (the other thread's calls are short and
        launched: their pins go when their GPU work is done)."""
        wanted = list({id(prompt): prompt for prompt in prompts}.values())
        if len(wanted) > self.capacity:
            return None
        with self._lock:
            new = [prompt for prompt in wanted if id(prompt) not in self._slots]
            if any(self.flow.voice_prefix_frames(prompt.tokens) > self.bank.frames for prompt in new):
                return None
            for prompt in wanted:
                if id(prompt) in self._slots:
                    self._slots.move_to_end(id(prompt))
            free = self._free_slots(wanted)
            while len(free) < len(new):
                self._waiting = True
                self._unpinned.wait()
                free = self._free_slots(wanted)
            self._waiting = False
            chosen = free[: len(new)]
            for key in [key for key, (_, slot) in self._slots.items() if slot in chosen]:
                del self._slots[key]  # the voice is gone before its slot is written: the lane cannot pin it
            bank = self.bank
        for prompt, slot in zip(new, chosen):  # the engine thread alone builds: outside the lock
            prompt_state = prompt.speech_tokens, prompt.speech_feat, prompt.embedding
            bank.put(slot, voice_prefix(self.flow, *prompt_state, self.steps, self.keep_inputs))
            written = None
            if bank.start.is_cuda:
                written = torch.cuda.Event()
                written.record(torch.cuda.current_stream(bank.start.device))
            with self._lock:
                self._written[slot] = written
                self._slots[id(prompt)] = (prompt, slot)
        with self._lock:
            return [self._slots[id(prompt)][1] for prompt in prompts]

    def _free_slots(self, wanted: list[VoicePrompt]) -> list[int]:
        """Slots a new voice of this call may take, unused ones first, then least recently used:
        none of the call's own voices', none pinned (under the lock)."""
        held = {slot for _, slot in self._slots.values()}
        wanted_keys = {id(prompt) for prompt in wanted}
        unused = [slot for slot in range(self.capacity) if slot not in held]
        evictable = [slot for key, (_, slot) in self._slots.items() if key not in wanted_keys and not self._pins[slot]]
        return unused + evictable

    def pin(self, prompts: list[VoicePrompt]) -> list[int] | None:
        """For a call of the other thread: these voices' slots, pinned; None, pinning nothing,
        unless the bank (of fixed width) holds every voice with its prefix's write done on the
        GPU, and the engine thread is not waiting for pins to go."""
        with self._lock:
            held = [self._slots.get(id(prompt)) for prompt in prompts]
            if not self._fixed or self._waiting or None in held:
                return None
            slots = [slot for _, slot in held]
            if any(self._written[slot] is not None and not self._written[slot].query() for slot in set(slots)):
                return None  # waiting for it would put the lane behind the engine thread's queued work
            self._pins.update(slots)
            return slots

    def unpin(self, slots: list[int]) -> None:
        """Slots ``pin`` gave a call whose GPU work is done."""
        with self._lock:
            self._pins.subtract(slots)
            self._pins = +self._pins  # drops the slots no call pins any more
            self._unpinned.notify_all()

    def shortest(self) -> int | None:
        """The shortest prefix the bank holds, in frames: what a call after the prefixes saves
        at least (None while it holds none)."""
        with self._lock:
            return min((self.flow.voice_prefix_frames(p.tokens) for p, _ in self._slots.values()), default=None)
