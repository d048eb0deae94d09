"""The flow decoder: an Euler ODE solver with classifier-free guidance around the
:class:`~tts_gateway.engine.cosyvoice2.model.estimator.Estimator` (``decoder`` in ``flow.pt``).

It integrates dx/dt = v(x, t | mu, spk, cond) from Gaussian noise (t = 0) to mel (t = 1)
with Euler steps on a cosine time grid: 10 as the official flow does, or ``n_timesteps``
(the engine's ``flow_steps`` setting). Each step evaluates the velocity twice in one
batch, with and without the conditions, and extrapolates away from the unconditional one
(guidance weight 0.7). Rows are independent.

Noise: the official decoder draws its starting noise once, at construction, as
``torch.randn(1, 80, 15000)`` after seeding the global RNG with 0, and every call uses
that tensor's first T frames. ``CFM.noise`` is the same tensor, drawn from a private
``torch.Generator`` seeded with 0 (so the global RNG is left alone); callers may pass
their own ``noise`` instead.

One Euler step (:meth:`CFM.euler_step`) may read its step index from a device tensor, so
that the serving layer can capture a step once in a CUDA graph and replay it for every
step (engine/cosyvoice2/serving/flow_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model.estimator import CachedFrames, Estimator
from tts_gateway.engine.cosyvoice2.modeldir.configs import CFMConfig


# The official flow always integrates with 10 Euler steps: the default everywhere a step
# count is asked for (the engine's flow_steps setting may ask for another).
N_TIMESTEPS = 10
# Seed and frame count of the official decoder's fixed noise (50 Hz x 300 s).
NOISE_SEED = 0
NOISE_FRAMES = 50 * 300


class CFM(nn.Module):
    """Euler ODE solver with classifier-free guidance around the ``Estimator`` (``decoder`` in flow.pt)."""

    def __init__(self, config: CFMConfig) -> None:
        super().__init__()
        if config.cfm_params.solver != "euler":
            raise ValueError(f"only the euler solver is supported, got {config.cfm_params.solver!r}")
        self.config = config
        self.estimator = Estimator(config.estimator)
        generator = torch.Generator().manual_seed(NOISE_SEED)
        noise = torch.randn(1, config.estimator.out_channels, NOISE_FRAMES, generator=generator)
        # Not a parameter of the checkpoint: kept out of the state dict, moved with .to().
        self.register_buffer("noise", noise, persistent=False)

    def time_grid(self, n_timesteps: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        if n_timesteps < 1:
            raise ValueError(f"the flow needs at least one Euler step, got {n_timesteps}")
        t_span = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
        if self.config.cfm_params.t_scheduler == "cosine":
            t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        return t_span

    def step_times(self, n_timesteps: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``[n_timesteps, 2]``: each Euler step's t and dt, accumulated as the official solver
        does (t += dt, then dt from the grid), in ``dtype``."""
        t_span = self.time_grid(n_timesteps, device, dtype)
        t, dt = t_span[0], t_span[1] - t_span[0]
        rows = []
        for step in range(n_timesteps):
            rows.append(torch.stack([t, dt]))
            t = t + dt
            if step + 1 < n_timesteps:
                dt = t_span[step + 2] - t
        return torch.stack(rows)

    @staticmethod
    def cfg_rows(mask: Tensor, mu: Tensor, spks: Tensor, cond: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The estimator's ``2B`` rows: the conditioned ones, then the same with mu, spks and cond zeroed."""
        return (
            torch.cat([mask, mask]),
            torch.cat([mu, torch.zeros_like(mu)]),
            torch.cat([spks, torch.zeros_like(spks)]),
            torch.cat([cond, torch.zeros_like(cond)]),
        )

    def euler_step(
        self,
        x: Tensor,
        step: int | Tensor,
        times: Tensor,
        rows: tuple[Tensor, Tensor, Tensor, Tensor],
        streaming: bool,
        view: CachedFrames | None = None,
    ) -> Tensor:
        """``x`` ``[B, 80, T]`` after Euler step ``step`` of ``times`` (``step_times``); ``rows``
        from ``cfg_rows``. ``step`` may be a one-element device tensor: it is then read on the
        device, so one CUDA graph of this call serves every step (serving/flow_graphs.py)."""
        t, dt = times[step] if isinstance(step, int) else times.index_select(0, step)[0]
        mask_in, mu_in, spks_in, cond_in = rows
        velocity = self.estimator(
            torch.cat([x, x]), mask_in, mu_in, t.expand(mask_in.shape[0]), spks_in, cond_in, streaming, view
        )
        conditioned, unconditioned = velocity.chunk(2)
        cfg_rate = self.config.cfm_params.inference_cfg_rate
        return x + dt * ((1.0 + cfg_rate) * conditioned - cfg_rate * unconditioned)

    def solve(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool,
        n_timesteps: int = N_TIMESTEPS,
        view_for_step: Callable[[int], CachedFrames | None] = lambda step: None,
    ) -> Tensor:
        """Integrates from noise ``x`` ``[B, 80, T]`` to mel; returns float32 ``[B, 80, T]``.

        Rows are independent: the estimator runs on ``2B`` rows, the conditioned ones
        then the same rows with mu, spks and cond zeroed.
        """
        times = self.step_times(n_timesteps, mu.device, mu.dtype)
        rows = self.cfg_rows(mask, mu, spks, cond)
        for step in range(n_timesteps):
            x = self.euler_step(x, step, times, rows, streaming, view_for_step(step))
        return x.float()

    def forward(
        self,
        mu: Tensor,
        mask: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool = False,
        noise: Tensor | None = None,
        n_timesteps: int = N_TIMESTEPS,
    ) -> Tensor:
        """Mel ``[B, 80, T]`` for mu/cond ``[B, 80, T]``, mask ``[B, 1, T]``, spks ``[B, 80]``.

        noise: ``[1 or B, 80, >= T]``, sliced to its first T frames (default: ``self.noise``).
        """
        frames = mu.shape[2]
        if noise is None:
            noise = self.noise
        x = noise[:, :, :frames].to(mu.dtype).expand(mu.shape[0], -1, -1)
        return self.solve(x, mask, mu, spks, cond, streaming, n_timesteps)
