"""The flow's arguments for chunks of several utterances, their rows padded into one batch.

A flow call of several chunks takes each utterance's tokens so far, its prompt's tokens and
mel, and its speaker embedding as batched tensors, rows padded to the longest, with their
lengths (``Flow.decoder_inputs``; the paged flow's ``Flow.inputs_after`` takes the prompt's
part). Each row of the call equals running it alone.
"""

from __future__ import annotations

import torch

from tts_gateway.engine.cosyvoice2.serving.chunking import ChunkJob
from tts_gateway.engine.cosyvoice2.serving.uploads import to_device


def _padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded into a batch, and their lengths."""
    lengths = to_device([len(row) for row in rows], torch.int32, rows[0].device)
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), lengths


def batch_args(jobs: list[ChunkJob]) -> tuple[torch.Tensor, ...]:
    """``Flow.decoder_inputs``' arguments up to ``embedding`` for these jobs, rows padded."""
    device = jobs[0].request.prompt.speech_feat.device
    token, token_len = _padded(
        [to_device(job.request.tokens[: job.end], torch.int32, device) for job in jobs]
    )
    prompt_token, prompt_token_len = _padded([job.request.prompt.speech_tokens[0] for job in jobs])
    return token, token_len, prompt_token, prompt_token_len, *prompt_args(jobs)


def prompt_args(jobs: list[ChunkJob]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The jobs' prompt mel (rows padded), its lengths and their speaker embeddings: the
    decoder's conditions (``Flow.inputs_after``)."""
    prompts = [job.request.prompt for job in jobs]
    return *_padded([p.speech_feat[0] for p in prompts]), torch.cat([p.embedding for p in prompts])
