"""Block verification: accept a sampled draft chain as a whole, not token by token.

Token verification (docs/DECODING.md) tests draft i with probability
min(1, p_i(x_i) / q_i(x_i)) and stops at the first rejection. A chain whose first token the
target finds less likely than the draft did loses the whole round even where the target likes
the next tokens more than the draft did. Block verification (Sun, Mendlovic, Leviathan, Aharoni,
Beirami, Ro and Suresh 2024, "Block Verification Accelerates Speculative Decoding") carries what
a token's ratio leaves over to the tokens after it. With p_i and q_i the target's and the draft's
distributions at draft position i (p_{g+1} after the last of g drafts):

    w_0 = 1,   w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i))
    r_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)),   h_i = r_i / (r_i + 1 - w_i)  (i < g),   h_g = w_g

With one uniform u_i per position, the round keeps the longest prefix tau = max{i : u_i < h_i}
(0 if there is none), then draws one token: from p_{g+1} when tau = g, else from the weighted
residual norm(max(0, w_tau p_{tau+1} - q_{tau+1})) (at tau = 0 the usual residual, w_0 = 1).

- Lossless: the emitted tokens are distributed exactly as the target's, for any draft. The
  paper proves it; `tests/test_block_verify.py` checks it by exact enumeration of every draft
  and every stopping point on small vocabularies (deviation below 1e-12), for chains of fixed
  length and for chains whose length depends on their own drafted prefix (the tree's probability
  floor), and the chi-square tests drive it through `generate`.
- Never fewer tokens: the paper proves its expected accepted length is the largest any valid
  verification of a single chain reaches, so at least token verification's; the enumeration
  test checks that too. Both take one uniform per position and one draw; the extra cost is a sum
  over the vocabulary per position.
- Where w_i = 1 (every ratio so far at least 1), h_i = 1 whenever r_i > 0: the round keeps at
  least i tokens, as token verification would. r_i = 0 with w_i = 1 means p_{i+1} = q_{i+1},
  where every later h is 1 too; h_i is then taken as 1 (it cannot decide the round).
- Greedy decoding does not use it: at temperature 0 the two methods accept the same tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..sampling import residual


def block_weights(p: Tensor, q: Tensor, drafts: Tensor) -> tuple[Tensor, Tensor]:
    """(w (b, g + 1), h (b, g)) of the module docstring for p (b, g + 1, vocab), q (b, g, vocab)
    and drafts (b, g) drawn from q: h[:, i - 1] is the probability that the round keeps exactly i
    drafts given that no test after position i passed (in float64: w is a running product)."""
    b, g = drafts.shape
    px = p[:, :g].gather(-1, drafts[..., None])[..., 0].double()
    qx = q.gather(-1, drafts[..., None])[..., 0].double().clamp(min=torch.finfo(torch.float64).tiny)
    w = [torch.ones(b, dtype=torch.float64, device=p.device)]
    for i in range(g):
        w.append(torch.clamp(w[-1] * px[:, i] / qx[:, i], max=1.0))
    weights = torch.stack(w, 1)                                                   # (b, g + 1)
    h = []
    for i in range(1, g):
        r = (weights[:, i, None] * p[:, i].double() - q[:, i].double()).clamp(min=0).sum(-1)
        denom = r + 1 - weights[:, i]
        h.append(torch.where(denom > 0, r / denom.clamp(min=torch.finfo(torch.float64).tiny), 1.0))
    h.append(weights[:, g])
    return weights, torch.stack(h, 1)


def block_verify(p: Tensor, q: Tensor, drafts: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Block verification of each row's chain: (tau (b,), the drafts kept; the distribution (b,
    vocab) the next token is drawn from). p (b, g + 1, vocab) and q (b, g, vocab) are the
    processed distributions (`sampling.to_probs`), drafts (b, g) drawn from q, u (b, g) uniforms."""
    b, g = drafts.shape
    weights, h = block_weights(p, q, drafts)
    passed = u.double() < h                                                       # (b, g)
    steps = torch.arange(1, g + 1, device=drafts.device)
    tau = (passed * steps).amax(1)                                                # 0 where none passed
    rows = torch.arange(b, device=drafts.device)
    at = tau.clamp(max=g - 1)
    w = weights[rows, at].to(p.dtype)[:, None]
    fix = residual(w * p[rows, at], q[rows, at])
    fix = fix / fix.sum(-1, keepdim=True)          # residual falls back to w * p where nothing is left
    final = torch.where((tau < g)[:, None], fix, p[:, g])
    return tau, final
