"""``tether rlhf`` / :class:`RLHFPipeline`: the classic pipeline as a list of stages, each in ``<out>/<stage>/``.

    task → [sft] → pairs_r0 → rm_r0 → ppo_beta{β}_r0, ppo_beta0_r0, [ppo_control_r0], [dpo_r0]
         → for each refresh round r: pairs_r{r} (the tethered arm's policy) → rm_r{r} (all pairs so far)
           → ppo_beta{β}_r{r} (from the current policy) [, ppo_beta0_r{r}]
         → report: held-out gold of every arm at every evaluation against step 0, the doctor, results.json

A stage is complete when its ``stage.json`` exists — written last, after its output — and is then skipped, so a
killed run restarts at the stage it was in (and inside SFT, the reward model and PPO at their own checkpoints).
The report is rebuilt every time (it only reads the arms' files).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tether.config import as_config, check_config, config_to_dict, save_config
from tether.errors import ConfigError
from tether.pipeline.config import RLHFConfig

MARKER = "stage.json"


@dataclass
class Stage:
    """One stage: its folder name, a line saying what it does, the work (``folder -> summary``), its kind."""

    name: str
    what: str
    work: Callable[[Path], dict]
    kind: str  # task, sft, pairs, rm, ppo, dpo: what the estimate prices it as
    arm: tuple = ()  # a PPO arm's (policy, beta, shuffled, round, steps): what a side-by-side process needs


def beta_name(beta: float) -> str:
    return f"beta{beta:g}"


class RLHFPipeline:
    """The pipeline from Python: ``RLHFPipeline(config).run()`` (``config``: an :class:`RLHFConfig`, a dict of its
    keys or a YAML path). ``after_stage(name)`` is called after each stage is complete (tests stop a run there);
    ``callbacks`` go to every PPO arm (:mod:`tether.callbacks`)."""

    def __init__(self, config=None, after_stage: Callable[[str], None] | None = None, callbacks=()):
        self.cfg = check_config(as_config(RLHFConfig, config if config is not None else RLHFConfig(), check=False))
        self.out = Path(self.cfg.output_dir)
        self.after_stage, self.callbacks = after_stage, callbacks

    # -- the plan ------------------------------------------------------------------------------------------------
    def arm_dir(self, arm: str, round_: int) -> Path:
        return self.out / f"ppo_{arm}_r{round_}"

    def plan(self) -> list[Stage]:
        from tether.pipeline import stages as s

        cfg, out = self.cfg, self.out
        task = out / "task"
        start = str(out / "sft") if cfg.sft.data else cfg.model.policy
        backbone = cfg.model.reward_model or start
        tethered = beta_name(cfg.ppo.kl_coef)
        plan = [Stage("task", f"training and held-out rows of {cfg.task.prompts}", lambda d: s.prepare_task(cfg, d),
                      "task")]
        if cfg.sft.data:
            plan.append(Stage("sft", f"SFT of {cfg.model.policy} on {cfg.sft.data}",
                              lambda d: s.sft_stage(cfg, task, d), "sft"))
        pair_files: list[str] = []
        for r in range(cfg.refresh.rounds + 1):
            policy = start if r == 0 else str(self.arm_dir(tethered, r - 1) / "policy")
            pair_files = pair_files + [str(out / f"pairs_r{r}" / "pairs.jsonl")]
            plan.append(Stage(f"pairs_r{r}", f"pairs from {policy}'s samples, labelled by the gold rule",
                              lambda d, p=policy, r=r: s.pairs_stage(cfg, task, p, d, cfg.seed + 1000 * r), "pairs"))
            plan.append(Stage(f"rm_r{r}", f"reward model on {len(pair_files)} round(s) of pairs",
                              lambda d, f=tuple(pair_files): s.rm_stage(cfg, backbone, list(f), d), "rm"))
            arms = [(tethered, cfg.ppo.kl_coef, False, cfg.ppo.steps)]
            if cfg.ppo.beta0 and (r == 0 or cfg.refresh.beta0):
                arms.append(("beta0", 0.0, False, cfg.ppo.beta0_steps or cfg.ppo.steps))
            if cfg.ppo.control and r == 0:
                arms.append(("control", cfg.ppo.kl_coef, True, cfg.ppo.steps))
            for arm, beta, shuffle, steps in arms:
                from_policy = start if r == 0 or arm == "control" else str(self.arm_dir(arm, r - 1) / "policy")
                args = (from_policy, beta, shuffle, r, steps)
                plan.append(Stage(self.arm_dir(arm, r).name,
                                  f"PPO beta = {beta:g}{', rewards shuffled' if shuffle else ''} against rm_r{r}",
                                  lambda d, a=args: s.run_ppo(self.ppo_config(d, *a), self.callbacks), "ppo", args))
        if cfg.dpo.run:
            from tether.pipeline.dpo_arm import dpo_stage

            plan.append(Stage("dpo_r0", "DPO on pairs_r0 from the start policy",
                              lambda d: dpo_stage(cfg, task, start, pair_files[0], d), "dpo"))
        return plan

    def ppo_config(self, d: Path, policy: str, beta: float, shuffle: bool, r: int, steps: int):
        from tether.pipeline.stages import ppo_config

        return ppo_config(self.cfg, self.out / "task", policy, str(self.out / f"rm_r{r}"), beta, shuffle, d, steps)

    # -- running -------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        from tether.pipeline.estimate import estimate_lines, estimate_stages
        from tether.pipeline.results import collect, write_results
        from tether.pipeline.stages import check_task

        check_task(self.cfg)  # a bad task or gold rule: one line, before anything is written
        if self.cfg.dpo.run:
            from tether.pipeline.dpo_arm import dpo_available

            if not dpo_available():
                raise ConfigError("--dpo: this tether has no `tether dpo` (tether.dpo.train); run without --dpo")
        self.out.mkdir(parents=True, exist_ok=True)
        changed = self.changed_settings()
        if changed:
            print(f"note: {self.out} was started with other settings ({changed}); its complete stages are kept as "
                  "they are: delete a stage's folder to run it again", flush=True)
        save_config(self.cfg, self.out / "config.yaml")
        plan, started = self.plan(), time.perf_counter()
        done = {st.name for st in plan if (self.out / st.name / MARKER).is_file()}
        print(f"tether rlhf -> {self.out}: {len(plan)} stages ({len(done)} complete)", flush=True)
        self.estimated, units = estimate_stages(self.cfg, self.out, plan, done)
        self.plan_run, self.actual = plan, {}
        for line in estimate_lines(self.cfg, plan, done, self.estimated, units):
            print("  " + line, flush=True)
        records = {}
        i = 0
        while i < len(plan):
            group = self.parallel_group(plan, i, done)
            if len(group) > 1:
                records.update(self.run_side_by_side(group))
            else:
                records[plan[i].name] = self.run_stage(plan[i])
            i += len(group)
        results = collect(self.cfg, self.out, plan, records)
        results["total_seconds"] = time.perf_counter() - started
        write_results(self.out, results)
        print(f"\ntether rlhf: report in {self.out / 'report.md'}, results in {self.out / 'results.json'}")
        return results

    def changed_settings(self) -> str:
        """The keys whose values differ from those of the run already in ``--output-dir`` ('' when none or new)."""
        import yaml

        from tether.config import flatten

        path = self.out / "config.yaml"
        if not path.is_file():
            return ""
        then = flatten(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
        now = flatten(config_to_dict(self.cfg))
        keys = [k for k in now if k not in ("estimate", "progress") and then.get(k) != now[k]]
        return ", ".join(f"{k} {then.get(k)!r} -> {now[k]!r}" for k in keys[:3]) + (" ..." if len(keys) > 3 else "")

    def run_stage(self, stage: Stage) -> dict:
        d = self.out / stage.name
        marker = d / MARKER
        if marker.is_file():
            print(f"\n== {stage.name}: skipped (complete: {marker})", flush=True)
            return json.loads(marker.read_text(encoding="utf-8"))
        from tether.checkpoint import list_checkpoints

        found = list_checkpoints(d) or list_checkpoints(d / "policy")  # the DPO arm trains into d/policy
        resuming = f" (resuming from {found[-1]})" if found else " (starting again: no checkpoint)" \
            if d.exists() else ""
        print(f"\n== {stage.name}: {stage.what}{resuming}", flush=True)
        t0 = time.perf_counter()
        summary = stage.work(d)
        return self.complete(stage.name, summary, time.perf_counter() - t0)

    def complete(self, name: str, summary: dict, seconds: float) -> dict:
        """Write the stage's marker (last, whole or not at all) and call ``after_stage``."""
        from tether.runlog import write_text_atomic

        record = {"stage": name, "seconds": round(seconds, 2), **summary}
        (self.out / name).mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.out / name / MARKER, json.dumps(record, indent=1) + "\n")
        print(f"   [{name}: {seconds:.1f} s{self.remaining_note(name, seconds)}]", flush=True)
        if self.after_stage is not None:
            self.after_stage(name)
        return record

    def remaining_note(self, name: str, seconds: float) -> str:
        """'; estimated …; the rest ~…' once a stage with an estimate is done: the later stages re-priced by what the
        done ones of their kind took (tether.pipeline.estimate.repriced_remaining)."""
        from tether.pipeline.estimate import fmt, repriced_remaining

        estimated = getattr(self, "estimated", {})
        if not estimated.get(name):
            return ""
        self.actual[name] = seconds
        rest = repriced_remaining(self.plan_run, estimated, self.actual)
        return f"; estimated {fmt(estimated[name])}" + (f"; the rest ~{fmt(rest)[1:]}, re-priced" if rest else "")

    def parallel_group(self, plan: list[Stage], i: int, done: set[str]) -> list[Stage]:
        """The PPO arms from ``plan[i]`` on that run side by side (``--parallel-arms``, cores permitting), else
        ``plan[i]`` alone."""
        if not self.cfg.parallel_arms or plan[i].kind != "ppo":
            return [plan[i]]
        from tether.demo.side_by_side import usable_cores

        group = []
        for st in plan[i:]:
            if st.kind != "ppo" or st.arm[3] != plan[i].arm[3]:  # a round's arms: the same reward model
                break
            group.append(st)
        pending = [st for st in group if st.name not in done]
        return group if 1 < len(pending) <= usable_cores() else [plan[i]]  # a core each at least

    def run_side_by_side(self, group: list[Stage]) -> dict:
        """A round's PPO arms, one process each (:func:`tether.demo.side_by_side.run_side_by_side`)."""
        import torch

        from tether.demo.side_by_side import run_side_by_side, usable_cores
        from tether.pipeline import stages as s

        records, jobs = {}, []
        for st in group:
            if (self.out / st.name / MARKER).is_file():
                records[st.name] = self.run_stage(st)  # skipped
                continue
            jobs.append((self.out / st.name, config_to_dict(self.ppo_config(self.out / st.name, *st.arm))))
        threads = max(1, usable_cores() // len(jobs))  # the cores shared out; the children take this count
        print(f"\n== {', '.join(j[0].name for j in jobs)}: side by side, one process each ({threads} thread(s) "
              "each)", flush=True)
        t0, before = time.perf_counter(), torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            run_side_by_side(s.run_ppo_process, jobs, max(st.arm[4] for st in group))
        finally:
            torch.set_num_threads(before)
        for run_dir, config in jobs:
            records[run_dir.name] = self.complete(run_dir.name, {"steps": config["steps"],
                                                                 "policy": str(run_dir / "policy")},
                                                  time.perf_counter() - t0)
        return records
