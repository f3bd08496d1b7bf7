"""Pairwise evaluation of a reward model (A4): accuracy with its Wilson interval and verdict, margin,
accuracy split by length, and the printed table. Works with any scorer that has
``score(prompts, responses, raw=, batch_size=)`` (a :class:`~tether.rm.model.RewardModel`, an ensemble).
"""

from __future__ import annotations

import torch

from tether.core.stats import wilson_interval
from tether.inputs.pairs import PreferencePair
from tether.errors import TetherError


def _group(correct: torch.Tensor) -> dict:
    n, k = int(correct.numel()), int(correct.sum())
    low, high = wilson_interval(k, n)
    return {"n": n, "accuracy": k / n if n else None, "wilson_low": low, "wilson_high": high}


def evaluate_pairs(scorer, pairs: list[PreferencePair], batch_size: int = 64) -> dict:
    """Pairwise evaluation (A4) of ``scorer`` (anything with ``score(prompts, responses, raw=)``).

    accuracy = share of pairs with r(chosen) > r(rejected) (ties count as wrong), its Wilson 95% interval
    and whether it excludes 0.5; mean margin E[r_w − r_l] in raw units (σ(margin) is the model's
    P(chosen ≻ rejected)); accuracy when the chosen reply is the longer / the shorter one (characters);
    the share of unequal-length pairs where the model prefers the longer reply, beside the accuracy of
    "always prefer the longer one"; the length-balanced accuracy (the mean of the chosen-longer and
    chosen-shorter accuracies: any rule that looks only at length scores 0.5 on it); accuracy per quartile of
    the longer reply's length.
    """
    if not pairs:
        raise TetherError("no held-out pairs to evaluate")
    prompts = [p.prompt for p in pairs]
    s_w = scorer.score(prompts, [p.chosen for p in pairs], raw=True, batch_size=batch_size)  # (N,)
    s_l = scorer.score(prompts, [p.rejected for p in pairs], raw=True, batch_size=batch_size)  # (N,)
    margin = s_w - s_l
    correct = margin > 0
    len_w = torch.tensor([len(p.chosen) for p in pairs])
    len_l = torch.tensor([len(p.rejected) for p in pairs])
    overall = _group(correct)
    differ = len_w != len_l
    picks_longer = (margin > 0) == (len_w > len_l)
    longest = torch.maximum(len_w, len_l).float()
    edges = torch.quantile(longest, torch.tensor([0.25, 0.5, 0.75])).unique()
    bucket = torch.bucketize(longest, edges, right=False)
    bounds = [float(longest.min()), *edges.tolist(), float(longest.max())]
    result = {
        "n_pairs": overall["n"], "n_correct": int(correct.sum()), "accuracy": overall["accuracy"],
        "wilson_low": overall["wilson_low"], "wilson_high": overall["wilson_high"],
        "excludes_chance": overall["wilson_low"] > 0.5 or overall["wilson_high"] < 0.5,
        "mean_margin": margin.mean().item(), "n_ties": int((margin == 0).sum()),
        "chosen_longer": _group(correct[len_w > len_l]), "chosen_shorter": _group(correct[len_w < len_l]),
        "same_length": _group(correct[~differ]),
        "length_balanced_accuracy": None,
        "prefers_longer": picks_longer[differ].float().mean().item() if differ.any() else None,
        "longer_wins_baseline": (len_w > len_l)[differ].float().mean().item() if differ.any() else None,
        "by_length": [{"chars": [bounds[b], bounds[b + 1]], **_group(correct[bucket == b])}
                      for b in range(len(bounds) - 1) if (bucket == b).any()],
    }
    halves = (result["chosen_longer"]["accuracy"], result["chosen_shorter"]["accuracy"])
    if None not in halves:  # "always longer" and "always shorter" both score exactly 0.5 here
        result["length_balanced_accuracy"] = sum(halves) / 2
    if getattr(scorer, "std", None):
        result["mean_margin_standardised"] = result["mean_margin"] / scorer.std
    return result


def format_evaluation(ev: dict) -> str:
    """The evaluation as a small text table."""
    verdict = ("includes 0.5: not distinguishable from chance" if not ev["excludes_chance"] else
               "excludes 0.5: better than chance" if ev["wilson_low"] > 0.5 else "excludes 0.5: WORSE than chance")

    def row(name: str, g: dict) -> str:
        acc = "   -  " if g["accuracy"] is None else f"{g['accuracy']:.3f}"
        return f"  {name:<22} n={g['n']:<6} accuracy {acc}  [{g['wilson_low']:.3f}, {g['wilson_high']:.3f}]"

    lines = [f"{'dev' if ev.get('split') == 'dev' else 'held-out'} evaluation ({ev['n_pairs']} pairs)",
             f"  accuracy               {ev['accuracy']:.3f}  Wilson 95% [{ev['wilson_low']:.3f}, "
             f"{ev['wilson_high']:.3f}]  interval {verdict}",
             f"  mean margin            {ev['mean_margin']:+.4f} (raw score units)",
             row("chosen is longer", ev["chosen_longer"]), row("chosen is shorter", ev["chosen_shorter"]),
             row("same length", ev["same_length"])]
    if ev.get("length_balanced_accuracy") is not None:
        lines.append(f"  length-balanced        {ev['length_balanced_accuracy']:.3f} (mean of the longer/shorter rows; "
                     f"length alone scores 0.500)")
    if ev["prefers_longer"] is not None:
        lines.append(f"  prefers longer reply   {ev['prefers_longer']:.3f} of unequal-length pairs "
                     f"('always longer' would score {ev['longer_wins_baseline']:.3f})")
    lines.append("  by length of the longer reply (characters):")
    lines += [row(f"  {b['chars'][0]:.0f}-{b['chars'][1]:.0f}", b) for b in ev["by_length"]]
    return "\n".join(lines)
