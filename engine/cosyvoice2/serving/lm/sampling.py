"""Speech-token samplers of the CosyVoice2 LLM stage.

Every sampler takes the log-probabilities of one decoding step (a 1-D tensor over the
speech classes) and the classes decoded so far, and returns one class id.

``ras_sampling`` (repetition-aware sampling) is what CosyVoice2 ships with: nucleus
sampling, except that a class already seen in the recent window is redrawn from the full
distribution, which breaks the token loops a plain top-k/top-p sampler falls into.

The random draws are the reference implementation's, one ``torch.multinomial`` call per
draw on the same probabilities, so a seeded run samples the very same classes. Pass a
``torch.Generator`` to keep a stream's draws off the global RNG.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from tts_gateway.engine.cosyvoice2.modeldir.configs import SamplingConfig

# (log-probabilities over the speech classes, classes decoded so far) -> the next class
Sampler = Callable[[torch.Tensor, Sequence[int]], int]


def nucleus_sampling(
    scores: torch.Tensor,
    top_p: float = 0.8,
    top_k: int = 25,
    generator: torch.Generator | None = None,
) -> int:
    """Draw from the most likely classes whose mass reaches ``top_p``, at most ``top_k`` of them.

    A class is kept while the mass of the classes before it is still below ``top_p``.
    The running mass is summed one class at a time in the scores' dtype, as the reference
    does: a vectorised cumsum may round differently right at the ``top_p`` boundary.
    """
    # stable sort: equal probabilities keep their class order, as in the reference
    probs, classes = scores.softmax(dim=0).sort(descending=True, stable=True)
    kept = 0
    mass = probs.new_zeros(())
    for prob in probs[:top_k]:
        if mass >= top_p:
            break
        mass = mass + prob
        kept += 1
    # multinomial takes unnormalised weights: the kept probabilities are drawn from as they are
    pick = probs[:kept].multinomial(1, replacement=True, generator=generator)
    return int(classes[pick].item())


def random_sampling(
    scores: torch.Tensor,
    decoded: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> int:
    """Draw from the full distribution."""
    return int(scores.softmax(dim=0).multinomial(1, replacement=True, generator=generator).item())


def ras_sampling(
    scores: torch.Tensor,
    decoded: Sequence[int],
    top_p: float = 0.8,
    top_k: int = 25,
    win_size: int = 10,
    tau_r: float = 0.1,
    generator: torch.Generator | None = None,
) -> int:
    """Repetition-aware sampling: nucleus, redrawn from the full distribution on repeats.

    The nucleus pick is redrawn when it occurs at least ``win_size * tau_r`` times among
    the last ``win_size`` decoded classes (with the shipped values: once in the last 10).
    """
    pick = nucleus_sampling(scores, top_p=top_p, top_k=top_k, generator=generator)
    repeats = sum(1 for seen in decoded[-win_size:] if seen == pick)
    if repeats >= win_size * tau_r:
        pick = random_sampling(scores, decoded, generator=generator)
    return pick


def greedy_sampling(scores: torch.Tensor, decoded: Sequence[int] = ()) -> int:
    """The most likely class (lowest id on ties); deterministic, for tests and debugging."""
    return int(scores.argmax(dim=0).item())


def make_sampler(config: SamplingConfig, generator: torch.Generator | None = None) -> Sampler:
    """The shipped ``ras_sampling`` bound to a model's sampling config."""
    return functools.partial(
        ras_sampling,
        top_p=config.top_p,
        top_k=config.top_k,
        win_size=config.win_size,
        tau_r=config.tau_r,
        generator=generator,
    )


def ras_log_probs(
    logits: torch.Tensor,
    recent: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_repeats: torch.Tensor,
) -> torch.Tensor:
    """The distribution ``ras_sampling`` draws from, batched, as log-probabilities.

    For a backend that samples once from a distribution (vLLM) instead of drawing twice:
    with ``pn`` the nucleus distribution (renormalised), ``p`` the full one and ``R`` the
    classes repeated at least ``min_repeats`` times in the window, ``ras_sampling`` returns
    a nucleus pick that is not in ``R``, or else a fresh draw from ``p``; so each class c
    has probability ``pn(c) * [c not in R] + pn(R) * p(c)``. Sampling that once is the
    same random process.

    logits ``[B, C]`` (any scale; masked classes at -inf); recent ``[B, W]`` the last
    decoded classes, -1 where there are fewer; top_p ``[B]``, top_k ``[B]`` (int),
    min_repeats ``[B]`` (``win_size * tau_r``). Returns ``[B, C]`` float32, -inf where the
    probability is 0.
    """
    probs = logits.float().softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    rank = torch.arange(probs.shape[-1], device=probs.device)
    keep_sorted = (mass_before < top_p[:, None]) & (rank[None, :] < top_k[:, None])
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    nucleus = probs * keep
    nucleus = nucleus / nucleus.sum(dim=-1, keepdim=True)
    # counts of each class in the window (-1 padding goes to a spare column, dropped)
    counts = torch.zeros(probs.shape[0], probs.shape[1] + 1, device=probs.device)
    counts.scatter_add_(-1, torch.where(recent < 0, probs.shape[1], recent), torch.ones_like(recent, dtype=counts.dtype))
    repeated = counts[:, :-1] >= min_repeats[:, None]
    redraw_mass = (nucleus * repeated).sum(dim=-1, keepdim=True)
    return (nucleus * ~repeated + redraw_mass * probs).log()
