"""The report of `muonclip compare`: the figures of both claims, their tables, plots and a plain reading.

**Token efficiency** (AdamW against Muon; runs keyed ``(optimizer, budget, seed)``):

* final validation loss of every optimizer and budget: mean ± sample standard deviation over
  the seeds, and each seed's value;
* the **budget-matched ratio**, the headline: the token budget, in multiples of Muon's, at which
  AdamW — trained with its own full schedule at each budget of ``budgets`` — reaches Muon's final
  loss (`budget_to_reach`: linear interpolation of AdamW's final loss between neighbouring
  budgets). Per seed (AdamW and Muon runs of one seed share their initial weights and batch
  order), then the mean ± sd; beyond the largest budget it is reported as "> B x";
* the **crossing ratio**, secondary: tokens after which Muon's validation loss, mid-schedule,
  first reaches AdamW's final loss at 1x (`tokens_to_reach`), over AdamW's tokens. It compares a
  point inside Muon's schedule with the end of AdamW's, which favours the faster starter: it is
  not a budget-matched figure;
* **wall-clock matched**: the median step times (forward + backward + step) of Muon's and
  AdamW's 1x runs give the AdamW budget that takes as many seconds as Muon's run,
  ``t_muon / t_adamw``, and AdamW's final loss is interpolated there, against Muon's (the longer
  AdamW runs are left out of the timing: they run at other moments, under whatever else shares
  the machine then).

**Stability** (Muon against MuonClip, the segment with no weight decay and ``stability_tau``):
the peak max logit over every layer and head (before QK-Clip) as a multiple of tau; MuonClip's
peak after its first clip, whose excess over tau is compared with one update's growth: the most
that one step added to plain Muon's max logit once it was above tau; clip events per layer;
final validation losses. It is a rescue at an excessive rate (2.5 times Muon's tuned rate, both
optimizers far above a tuned run's loss); the **tuned-rate segment** asks the other question,
whether the clip costs anything where a tuned run would use it: the same segment at Muon's tuned
rate with tau set where the clip fires, per seed plain Muon's peak, MuonClip's clips and the loss
difference MuonClip - Muon.

**Precision**: a ratio is printed at the precision its seeds allow ("about 2.6x, 2.4–2.8 per
seed": `decimals`), and the figures are said to repeat on the same CPU kind only.

Plots (PNG): ``val_loss.png`` (validation loss against tokens, every optimizer and budget,
mean over seeds with the min-max band), ``budget.png`` (AdamW's final loss against its budget,
Muon's at 1x, the crossing), ``max_logit.png`` (stability: max logit per step, tau and 3 tau)
and ``clip_events.png`` (heads clipped per step).

MuonClip's max logits at or below tau may be upper bounds from the attention kernel's LSE rather
than exact maxima (the gated capture, docs/design.md, "Max logits nearly free: the LSE gate";
the ``max_logit_is_bound`` column of `muonclip.app.metrics`): the tables print such a value with
"≤" and ``max_logit.png`` draws it as a hollow marker. Values above tau are always exact.

The three parts: `figures` (the numbers), `markdown` (the tables, the reading, the summary
files), `plots` (the PNGs).
"""

from .figures import (
    budget_to_reach,
    clip_audit,
    efficiency,
    experts,
    interpolate,
    mean_sd,
    stability,
    summarize_run,
    tokens_to_reach,
)
from .markdown import (
    NAMES,
    about,
    against_muon,
    clip_audit_markdown,
    decimals,
    efficiency_markdown,
    experts_markdown,
    protocol_markdown,
    reading,
    stability_markdown,
    tuned_stability_markdown,
    write_summary,
)
from .plots import plot_efficiency, plot_stability

__all__ = [
    "NAMES", "budget_to_reach", "clip_audit", "clip_audit_markdown", "efficiency", "efficiency_markdown", "experts",
    "experts_markdown", "interpolate", "mean_sd", "plot_efficiency", "plot_stability", "reading", "stability",
    "stability_markdown", "summarize_run", "tokens_to_reach", "write_summary", "about", "against_muon", "decimals",
    "protocol_markdown", "tuned_stability_markdown",
]
