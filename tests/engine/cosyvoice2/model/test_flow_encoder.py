"""tts_gateway.engine.cosyvoice2.model.flow_encoder against the official CosyVoice2 flow (same random weights).

The official ``UpsampleConformerEncoder`` hard-codes 512 channels for its look-ahead
and upsampling convs. For narrow test models the official module gets those two
submodules rebuilt from the official classes at the narrow width; one test runs the
unmodified official module at the real width (512) instead.

The official flow's mu is taken from ``CausalMaskedDiffWithXvec.inference`` itself,
with a stand-in decoder that returns mu unchanged as the "mel" (and no prompt mel, so
nothing is cut off): every step before the decoder is the official code.
"""

from __future__ import annotations

import ast
import dataclasses

import pytest
import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model.flow_encoder import TokenEncoder, UpsampleConformerEncoder, encode_tokens
from tts_gateway.engine.cosyvoice2.serving.incremental_encoder import (
    EncoderStreamState,
    IncrementalEncoder,
    SessionCaches,
)
from tts_gateway.engine.cosyvoice2.modeldir.configs import FlowEncoderConfig
from tests.reference import official
from tests.reference import randomize as reference_randomize
from tests.paths import ROOT

TOL = 1e-4
VOCAB = 6561
CHUNK = 25  # tokens; FlowEncoderConfig.tiny() keeps the real chunk size


def randomize(module: nn.Module, seed: int) -> nn.Module:
    return reference_randomize(module, seed, spread=0.2)


def official_encoder(config: FlowEncoderConfig) -> nn.Module:
    module = official("cosyvoice.transformer.upsample_encoder")
    encoder = module.UpsampleConformerEncoder(**dataclasses.asdict(config))
    if config.output_size != 512:
        encoder.pre_lookahead_layer = module.PreLookaheadLayer(channels=config.output_size, pre_lookahead_len=3)
        encoder.up_layer = module.Upsample1D(config.output_size, config.output_size, stride=2)
    return encoder


class PassThroughDecoder(nn.Module):
    """Stands in for the official flow-matching decoder: the "mel" it returns is mu."""

    def forward(self, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, n_timesteps: int, streaming: bool):
        self.spks = spks
        return mu, None


def official_flow(config: FlowEncoderConfig, seed: int) -> nn.Module:
    flow_module = official("cosyvoice.flow.flow")
    flow = flow_module.CausalMaskedDiffWithXvec(
        input_size=config.input_size,
        output_size=80,
        spk_embed_dim=192,
        vocab_size=VOCAB,
        input_frame_rate=25,
        token_mel_ratio=2,
        pre_lookahead_len=3,
        encoder=official_encoder(config),
        decoder=PassThroughDecoder(),
    )
    return randomize(flow, seed)


def official_mu(flow: nn.Module, token: Tensor, prompt: Tensor, embedding: Tensor, streaming: bool, finalize: bool):
    """(mu [1, 80, T], spk [1, 80]) of the official inference for one utterance."""
    mu, _ = flow.inference(
        token,
        torch.tensor([token.size(1)]),
        prompt,
        torch.tensor([prompt.size(1)]),
        torch.zeros(1, 0, 80),
        torch.tensor([0]),
        embedding,
        streaming,
        finalize,
    )
    return mu, flow.decoder.spks


def ours_from(flow: nn.Module, config: FlowEncoderConfig) -> TokenEncoder:
    ours = TokenEncoder(config, vocab_size=VOCAB).eval()
    ours.load_state_dict(flow.state_dict(), strict=True)
    return ours


def tokens(n: int, seed: int) -> Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def max_diff(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


@pytest.fixture(scope="module")
def tiny_flow() -> tuple[nn.Module, TokenEncoder]:
    config = FlowEncoderConfig.tiny()
    flow = official_flow(config, seed=0)
    return flow, ours_from(flow, config)


# --- the encoder module ---------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("with_context", [False, True])
def test_equivalence_flow_encoder_module(streaming: bool, with_context: bool) -> None:
    """The encoder alone, both directions of loading; 63 frames = 2 chunks + a partial one."""
    config = FlowEncoderConfig.tiny()
    generator = torch.Generator().manual_seed(3)
    xs = torch.randn(1, 63, config.input_size, generator=generator)
    context = torch.randn(1, 3, config.input_size, generator=generator) if with_context else None
    lens = torch.tensor([63 + (3 if with_context else 0)])  # the official flow counts the context in

    reference = randomize(official_encoder(config), seed=1)
    ours = UpsampleConformerEncoder(config).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    ours_reverse = randomize(UpsampleConformerEncoder(config), seed=2)
    reference_reverse = official_encoder(config).eval()
    reference_reverse.load_state_dict(ours_reverse.state_dict(), strict=True)

    kwargs = {"context": context} if with_context else {}
    with torch.no_grad():
        for theirs, mine in ((reference, ours), (reference_reverse, ours_reverse)):
            expected, expected_masks = theirs(xs, lens, streaming=streaming, **kwargs)
            got, masks = mine(xs, lens, streaming=streaming, **kwargs)
            assert got.shape == (1, 126, config.output_size)
            assert torch.equal(masks, expected_masks)
            assert max_diff(got, expected) <= TOL
            assert expected.abs().max() > 1.0  # not a degenerate comparison


def test_equivalence_flow_encoder_real_width() -> None:
    """The unmodified official module (its convs hard-code 512 channels) at the real width."""
    config = dataclasses.replace(FlowEncoderConfig.full(), linear_units=64, num_blocks=1)
    reference = randomize(official_encoder(config), seed=4)
    ours = UpsampleConformerEncoder(config).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    generator = torch.Generator().manual_seed(5)
    xs = torch.randn(1, 30, 512, generator=generator)
    context = torch.randn(1, 3, 512, generator=generator)
    with torch.no_grad():
        for streaming in (False, True):
            expected, _ = reference(xs, torch.tensor([33]), context=context, streaming=streaming)
            got, _ = ours(xs, torch.tensor([33]), context=context, streaming=streaming)
            assert max_diff(got, expected) <= TOL


def test_equivalence_flow_encoder_module_batched() -> None:
    """Padded rows with their own lengths and look-ahead: each row as the official computes it alone."""
    config = FlowEncoderConfig.tiny()
    reference = randomize(official_encoder(config), seed=6)
    ours = UpsampleConformerEncoder(config).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    generator = torch.Generator().manual_seed(7)
    lengths = [58, 31, 7]
    xs = torch.randn(3, 58, config.input_size, generator=generator)
    context = torch.randn(3, 3, config.input_size, generator=generator)
    context_lens = torch.tensor([3, 0, 3])
    with torch.no_grad():
        for streaming in (False, True):
            got, masks = ours(
                xs, torch.tensor(lengths), context=context, streaming=streaming, context_lens=context_lens
            )
            for row, n in enumerate(lengths):
                ahead = {"context": context[row : row + 1]} if context_lens[row] else {}
                expected, _ = reference(xs[row : row + 1, :n], torch.tensor([n]), streaming=streaming, **ahead)
                assert max_diff(got[row : row + 1, : 2 * n], expected) <= TOL
                assert masks[row, 0].sum() == 2 * n


# --- the flow's token encoding --------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("finalize", [True, False])
def test_equivalence_flow_encoder_tokens(tiny_flow, streaming: bool, finalize: bool) -> None:
    """encode_tokens against the official CausalMaskedDiffWithXvec.inference (prompt + new tokens)."""
    flow, ours = tiny_flow
    prompt, token = tokens(17, seed=8), tokens(41, seed=9)
    embedding = torch.randn(1, 192, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        expected_mu, expected_spk = official_mu(flow, token, prompt, embedding, streaming, finalize)
        mu, mel_len, spk = encode_tokens(
            ours, token, torch.tensor([41]), prompt, torch.tensor([17]), embedding, streaming, finalize
        )
    assert mel_len.tolist() == [expected_mu.size(2)] == [2 * (58 - (0 if finalize else 3))]
    assert max_diff(mu, expected_mu) <= TOL
    assert max_diff(spk, expected_spk) <= TOL


def test_equivalence_flow_encoder_tokens_reverse() -> None:
    """Our random flow parts load strictly into the official flow and give its mu."""
    config = FlowEncoderConfig.tiny()
    ours = randomize(TokenEncoder(config, vocab_size=VOCAB), seed=30)
    flow = official_flow(config, seed=31)
    flow.load_state_dict(ours.state_dict(), strict=True)
    prompt, token = tokens(9, seed=32), tokens(60, seed=33)
    embedding = torch.randn(1, 192, generator=torch.Generator().manual_seed(34))
    with torch.no_grad():
        for streaming, finalize in ((True, False), (False, True)):
            expected_mu, expected_spk = official_mu(flow, token, prompt, embedding, streaming, finalize)
            mu, _, spk = encode_tokens(
                ours, token, torch.tensor([60]), prompt, torch.tensor([9]), embedding, streaming, finalize
            )
            assert max_diff(mu, expected_mu) <= TOL
            assert max_diff(spk, expected_spk) <= TOL


def test_equivalence_flow_encoder_tokens_batched(tiny_flow) -> None:
    """Rows of different prompt/new lengths and finalize flags: each row as it is alone (and officially)."""
    flow, ours = tiny_flow
    prompts = [tokens(n, seed=20 + n) for n in (17, 0, 30)]
    news = [tokens(n, seed=40 + n) for n in (41, 12, 55)]
    finalize = [True, False, False]
    embedding = torch.randn(3, 192, generator=torch.Generator().manual_seed(11))
    prompt_batch = nn.utils.rnn.pad_sequence([p[0] for p in prompts], batch_first=True, padding_value=-1)
    token_batch = nn.utils.rnn.pad_sequence([t[0] for t in news], batch_first=True, padding_value=-1)
    prompt_len = torch.tensor([p.size(1) for p in prompts])
    token_len = torch.tensor([t.size(1) for t in news])
    with torch.no_grad():
        for streaming in (False, True):
            mu, mel_len, spk = encode_tokens(
                ours, token_batch, token_len, prompt_batch, prompt_len, embedding, streaming, torch.tensor(finalize)
            )
            for row in range(3):
                alone, alone_len, alone_spk = encode_tokens(
                    ours, news[row], token_len[row : row + 1], prompts[row], prompt_len[row : row + 1],
                    embedding[row : row + 1], streaming, finalize[row],
                )
                expected, _ = official_mu(
                    flow, news[row], prompts[row], embedding[row : row + 1], streaming, finalize[row]
                )
                n = int(mel_len[row])
                assert n == int(alone_len[0]) == expected.size(2)
                assert max_diff(mu[row : row + 1, :, :n], alone) <= 1e-5
                assert max_diff(mu[row : row + 1, :, :n], expected) <= TOL
                assert max_diff(spk[row : row + 1], alone_spk) <= 1e-6
                assert torch.all(mu[row, :, n:] == 0)


def test_a_call_too_large_for_one_pass_is_encoded_in_groups_of_rows(tiny_flow, monkeypatch) -> None:
    """Past ENCODER_PASS_ELEMENTS the rows are encoded in groups (the attention scores of many
    long turns at once ran a GPU out of memory): every row as in one pass, padding zero."""
    from tts_gateway.engine.cosyvoice2.model import flow_encoder

    _, ours = tiny_flow
    prompts = [tokens(n, seed=60 + n)[0] for n in (17, 0, 30)]
    news = [tokens(n, seed=80 + n)[0] for n in (41, 12, 55)]
    args = (
        nn.utils.rnn.pad_sequence(news, batch_first=True, padding_value=-1),
        torch.tensor([len(t) for t in news]),
        nn.utils.rnn.pad_sequence(prompts, batch_first=True, padding_value=-1),
        torch.tensor([len(p) for p in prompts]),
        torch.randn(3, 192, generator=torch.Generator().manual_seed(12)),
        True,
        torch.tensor([True, False, False]),
    )
    calls = []
    encode = flow_encoder.UpsampleConformerEncoder._forward_rows

    def counted(self, frames, *rest, **kwargs):
        calls.append(frames.size(0))
        return encode(self, frames, *rest, **kwargs)

    monkeypatch.setattr(flow_encoder.UpsampleConformerEncoder, "_forward_rows", counted)
    with torch.no_grad():
        whole = encode_tokens(ours, *args)
        # The up blocks' frames of the longest row (its look-ahead held back unless it is final):
        # a bound of two such rows' scores.
        frames = 2 * max(len(p) + len(t) - (0 if f else 3) for p, t, f in zip(prompts, news, args[6].tolist()))
        monkeypatch.setattr(flow_encoder, "ENCODER_PASS_ELEMENTS", 2 * ours.encoder.config.attention_heads * frames**2)
        grouped = encode_tokens(ours, *args)
    assert calls == [3, 2, 1]
    assert grouped[0].shape == whole[0].shape
    assert max_diff(grouped[0], whole[0]) <= 1e-5
    assert torch.equal(grouped[1], whole[1])
    assert max_diff(grouped[2], whole[2]) <= 1e-6


# --- streaming: chunk causality and the incremental encoder ---------------------------


def test_flow_encoder_chunk_causality(tiny_flow) -> None:
    """The official flow, streaming, finalize=False: complete chunks never change, the partial one does.

    Tokens 0..52 encode 50 tokens (2 complete chunks, 3 held back), 0..62 add 10 tokens
    of a third chunk, 0..152 encode 6 chunks. Frames are mel frames (2 per token).
    """
    flow, _ = tiny_flow
    all_tokens = tokens(153, seed=12)
    embedding = torch.randn(1, 192, generator=torch.Generator().manual_seed(13))
    empty = all_tokens[:, :0]

    def mu(n: int, streaming: bool, finalize: bool = False) -> Tensor:
        return official_mu(flow, all_tokens[:, :n], empty, embedding, streaming, finalize)[0]

    two_chunks, partial, six_chunks = mu(53, True), mu(63, True), mu(153, True)
    assert max_diff(two_chunks, six_chunks[:, :, :100]) <= 1e-5  # measured ~1.4e-6
    assert max_diff(partial[:, :, :100], six_chunks[:, :, :100]) <= 1e-5
    assert max_diff(partial[:, :, 100:], six_chunks[:, :, 100:120]) > 1e-3  # measured 0.049: it attends to more later

    # Full attention (streaming=False): everything moves.
    assert max_diff(mu(53, False), mu(153, False)[:, :, :100]) > 1e-2  # measured 0.10

    # finalize=True pads the look-ahead of the last 3 tokens with zeros: their frames differ from a
    # continued stream, earlier chunks do not.
    final = mu(153, True, finalize=True)
    assert max_diff(final[:, :, :300], six_chunks) <= 1e-5
    final_60 = mu(60, True, finalize=True)
    assert max_diff(final_60[:, :, :100], six_chunks[:, :, :100]) <= 1e-5
    assert max_diff(final_60[:, :, 114:], six_chunks[:, :, 114:120]) > 0.1  # measured ~1.1


def _check_against_full(
    flow: nn.Module, history: Tensor, out_mu: Tensor, start: int, length: int, finalize: bool
) -> float:
    """Max abs difference of a step's frames from the official full re-run over ``history``."""
    expected, _ = official_mu(flow, history, history[:, :0], torch.zeros(1, 192), True, finalize)
    assert start + length == expected.size(2)
    return max_diff(out_mu[:, :, :length], expected[:, :, start:])


@pytest.mark.parametrize("feeds", [[37 + 13 + 3, 25, 25, 25, 9], [5, 30, 1, 2, 40, 0, 17, 11]])
def test_flow_encoder_incremental_matches_full(tiny_flow, feeds: list[int]) -> None:
    """Each incremental step returns exactly the official full re-run's frames from the last complete chunk on.

    The first schedule is the official one (a 37-token prompt, a first hop of 25 + 13
    to reach a chunk border, hops of 25, 3 tokens of look-ahead, then the rest with
    finalize); the second is irregular, so partial chunks are returned and revised.
    """
    flow, ours = tiny_flow
    incremental = IncrementalEncoder(ours)
    state = EncoderStreamState()
    all_tokens = tokens(sum(feeds), seed=14)
    seen = 0
    final_frames = None
    for step, n in enumerate(feeds):
        finalize = step == len(feeds) - 1
        out = incremental.step([state], [all_tokens[0, seen : seen + n]], finalize)
        seen += n
        start, length = int(out.mel_start[0]), int(out.mel_len[0])
        assert start % (2 * CHUNK) == 0
        assert finalize or int(out.mel_final[0]) % (2 * CHUNK) == 0
        if length:
            assert _check_against_full(flow, all_tokens[:, :seen], out.mu, start, length, finalize) <= TOL
        if final_frames is not None:  # a step starts where the frames declared final end
            assert start == final_frames
        final_frames = int(out.mel_final[0])
    assert state.finished


def test_flow_encoder_incremental_batched(tiny_flow) -> None:
    """Sessions at different positions stepped together, and a forked prompt cache: each as alone."""
    _, ours = tiny_flow
    incremental = IncrementalEncoder(ours)
    feeds = {"a": [40, 25, 25, 7], "b": [3, 60, 0, 12], "c": [77, 1, 30, 25]}
    streams = {name: tokens(sum(f), seed=15 + i) for i, (name, f) in enumerate(feeds.items())}

    def run(names: list[str], states: dict[str, EncoderStreamState]) -> dict[str, list[Tensor]]:
        outs: dict[str, list[Tensor]] = {name: [] for name in names}
        seen = dict.fromkeys(names, 0)
        for step in range(4):
            chunk = []
            for name in names:
                n = feeds[name][step]
                chunk.append(streams[name][0, seen[name] : seen[name] + n])
                seen[name] += n
            out = incremental.step([states[name] for name in names], chunk, finalize=step == 3)
            for row, name in enumerate(names):
                outs[name].append(out.mu[row, :, : int(out.mel_len[row])])
        return outs

    together = run(list(feeds), {name: EncoderStreamState() for name in feeds})
    for name in feeds:
        alone = run([name], {name: EncoderStreamState()})[name]
        for got, expected in zip(together[name], alone):
            assert max_diff(got, expected) <= 1e-5

    # A prompt encoded once and forked: the continuation equals encoding it all in one session.
    prompt, rest = streams["c"][0, :77], streams["c"][0, 77:]
    base = EncoderStreamState()
    incremental.step([base], [prompt])
    fork_a, fork_b = base.fork(), base.fork()
    out_a = incremental.step([fork_a], [rest], finalize=True)
    incremental.step([fork_b], [rest[:10]])
    assert base.committed == 50 and fork_b.committed == 75  # the fork did not touch the shared state
    whole = EncoderStreamState()
    incremental.step([whole], [prompt])
    out_whole = incremental.step([whole], [rest], finalize=True)
    assert max_diff(out_a.mu, out_whole.mu) <= 1e-6


def test_incremental_steps_too_large_for_one_pass_run_in_groups_of_sessions(tiny_flow, monkeypatch) -> None:
    """Past ENCODER_PASS_ELEMENTS (new frames over cached and new ones, per head) a step takes
    its sessions in groups: each session's output and state as in one pass."""
    from tts_gateway.engine.cosyvoice2.model import flow_encoder

    _, ours = tiny_flow
    incremental = IncrementalEncoder(ours)
    feeds = [[40, 25, 7], [3, 60, 12], [77, 30, 25]]
    streams = [tokens(sum(f), seed=30 + i)[0] for i, f in enumerate(feeds)]

    def run(bound: int) -> list:
        monkeypatch.setattr(flow_encoder, "ENCODER_PASS_ELEMENTS", bound)
        states = [EncoderStreamState() for _ in feeds]
        outs = []
        for step in range(3):
            chunk = [s[sum(f[:step]) : sum(f[: step + 1])] for s, f in zip(streams, feeds)]
            outs.append(incremental.step(states, chunk, finalize=step == 2))
        return outs

    passes = []
    forward = incremental.encoder._forward_rows

    def counted(frames, *rest, **kwargs):
        passes.append(frames.size(0))
        return forward(frames, *rest, **kwargs)

    built = []  # sessions per padded copy of the caches
    batch_rows = SessionCaches.rows

    def counted_copy(self, start, stop):
        built.append(stop - start)
        return batch_rows(self, start, stop)

    monkeypatch.setattr(incremental.encoder, "_forward_rows", counted)
    monkeypatch.setattr(SessionCaches, "rows", counted_copy)
    whole = run(1 << 40)
    assert passes == [3, 3, 3] and built == [3, 3, 3]
    grouped = run(1)
    assert passes[3:] == [1] * 9  # every step's three sessions one at a time
    assert built[3:] == [1] * 9  # and their caches copied one at a time
    # A bound that two sessions' scores of the last step fit but not their cached keys and values.
    states = [EncoderStreamState() for _ in feeds]
    for step in range(2):
        incremental.step(states, [s[sum(f[:step]) : sum(f[: step + 1])] for s, f in zip(streams, feeds)])
    assert [s.committed for s in states] == [50, 50, 100]
    encoder, cached = incremental.encoder, 100
    blocks = len(encoder.encoders) + encoder.stride * len(encoder.up_encoders)  # cached frames per token
    copied = 2 * encoder.config.output_size * cached * blocks
    queries = encoder.stride * (7 + 25)  # the widest row of the last step: 7 pending + 25 new tokens
    scores = encoder.config.attention_heads * queries * (encoder.stride * cached + queries)
    assert 2 * scores < 2 * copied - 1
    monkeypatch.setattr(flow_encoder, "ENCODER_PASS_ELEMENTS", 2 * copied - 1)
    del built[:]
    last = incremental.step(states, [s[sum(f[:2]) :] for s, f in zip(streams, feeds)], finalize=True)
    assert built == [1, 1, 1]
    assert last.mu.shape == whole[2].mu.shape and max_diff(last.mu, whole[2].mu) <= 1e-5
    for a, b in zip(grouped, whole):
        assert a.mu.shape == b.mu.shape and max_diff(a.mu, b.mu) <= 1e-5
        assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("mel_start", "mel_len", "mel_final"))


# --- structure ------------------------------------------------------------------------


def test_flow_encoder_full_size_keys() -> None:
    """The real config: the same state-dict keys and shapes as the official flow without its decoder."""
    config = FlowEncoderConfig.full()
    with torch.device("meta"):
        reference = official("cosyvoice.flow.flow").CausalMaskedDiffWithXvec(
            input_size=512, output_size=80, spk_embed_dim=192, vocab_size=6561, input_frame_rate=25,
            token_mel_ratio=2, pre_lookahead_len=3, encoder=official_encoder(config), decoder=None,
        )
        ours = TokenEncoder(config)
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == expected
    assert len(got) == 211 and expected["encoder.up_layer.conv.weight"] == (512, 512, 5)


def test_flow_encoder_runtime_imports() -> None:
    """The runtime module imports only the standard library, torch and this product (none of the official stack)."""
    source = ROOT / "engine" / "cosyvoice2" / "model" / "flow_encoder.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "dataclasses", "math", "collections", "typing", "torch", "tts_gateway"}, imported
