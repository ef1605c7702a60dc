"""What QK-Clip may be handed for one layer under the LSE gate (`muonclip.attention._gate`)."""

from __future__ import annotations

import torch


def assert_clip_input(got, bounded, exact, tau, rtol=1e-5, atol=1e-5):
    """``got`` (the maxima a clip used) against ``exact`` (the reference maxima): equal where
    ``bounded`` is False; where True, an upper bound of the exact max at or below ``tau``; and
    no head whose exact max exceeds ``tau`` is a bound. So the clip decisions and gammas are
    those of the exact maxima (rounding aside)."""
    got, exact = got.float().cpu(), exact.float().cpu()
    bounded = torch.zeros_like(got, dtype=torch.bool) if bounded is None else bounded.cpu()
    torch.testing.assert_close(got[~bounded], exact[~bounded], rtol=rtol, atol=atol)
    assert bool((got[bounded] >= exact[bounded] - atol - rtol * exact[bounded].abs()).all()), (got, exact)
    assert bool((got[bounded] <= tau).all()), (got, tau)
    assert not bool((bounded & (exact > tau)).any()), "a head above tau was recorded as a bound"
