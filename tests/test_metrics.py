"""The step's metrics over several processes (B12): pooled over all processes' tokens and kept rows, checked
against plain torch on the concatenated elements, with uneven token counts — where a mean of per-process means
(what the step reported before) differs; ``objective/kl`` is the KL controller's input."""

import pytest
import torch
from launcher import spawn_gloo

from tether.ppo.metrics import objective_metrics, value_metrics
from tether.ppo.processes import Processes


def shard(rank: int) -> dict:
    """Process 0: one row of 1 token and a dropped row; process 1: two rows of 9 and 4 tokens."""
    g = torch.Generator().manual_seed(rank)
    mask = torch.tensor([[1.0] + [0.0] * 8, [0.0] * 9]) if rank == 0 else \
        torch.tensor([[1.0] * 9, [1.0] * 4 + [0.0] * 5])
    valid = torch.tensor([True, False]) if rank == 0 else torch.tensor([True, True])
    kl = (torch.rand(2, 9, generator=g) + 3.0 * (rank == 0)) * mask  # process 0's token carries a large KL
    values, returns = torch.randn(2, 9, generator=g) * mask, torch.randn(2, 9, generator=g) * mask
    return {"mask": mask, "valid": valid, "kl": kl, "values": values, "returns": returns,
            "scores": torch.randn(2, generator=g), "rewards": torch.randn(2, 9, generator=g) * mask}


def metrics_on(rank: int, world_size: int, port: int, out) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world_size)
    try:
        p = Processes(accelerator=None, device=torch.device("cpu"), world_size=world_size, rank=rank)
        s = shard(rank)
        from tether.ppo.metrics import global_masked_mean

        kl_mean = global_masked_mean(p, s["kl"], s["mask"])
        got = {**objective_metrics(p, s["scores"], s["scores"], s["rewards"], s["kl"], s["mask"], s["valid"],
                                   kl_mean, 0.1),
               **value_metrics(p, s["values"], s["returns"], s["mask"])}
        out.put((rank, got))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_process_metrics():
    return spawn_gloo(metrics_on, 2)


def pooled(key: str, mask_key: str = "mask") -> torch.Tensor:
    """The valid elements of both processes, concatenated: what one process holding all rows would average."""
    parts = [shard(r) for r in range(2)]
    return torch.cat([p[key][p[mask_key].bool()] for p in parts]).double()


def test_token_means_are_pooled_over_processes_not_means_of_their_means(two_process_metrics):
    m0, m1 = two_process_metrics[0], two_process_metrics[1]
    assert m0 == m1  # every process reports the same figures
    kl = pooled("kl")
    assert m0["objective/kl"] == pytest.approx(kl.mean().item(), rel=1e-9)
    per_process = [shard(r)["kl"].sum() / shard(r)["mask"].sum() for r in range(2)]
    assert abs(m0["objective/kl"] - float(sum(per_process) / 2)) > 0.5  # the old figure was far off
    values, returns = pooled("values"), pooled("returns")
    assert m0["value/mean"] == pytest.approx(values.mean().item(), rel=1e-9)
    assert m0["value/std"] == pytest.approx(values.std(unbiased=False).item(), rel=1e-9)
    assert m0["value/returns_std"] == pytest.approx(returns.std(unbiased=False).item(), rel=1e-9)
    ev = 1.0 - (returns - values).var(unbiased=False) / returns.var(unbiased=False)
    assert m0["value/explained_variance"] == pytest.approx(ev.item(), rel=1e-6)  # R − V in float32


def test_row_means_count_kept_rows_only(two_process_metrics):
    m = two_process_metrics[0]
    parts = [shard(r) for r in range(2)]
    kept_kl_sums = torch.cat([p["kl"].sum(dim=1)[p["valid"]] for p in parts]).double()
    assert m["objective/kl_sequence"] == pytest.approx(kept_kl_sums.mean().item(), rel=1e-9)  # 3 rows, not 4
    kept_scores = torch.cat([p["scores"][p["valid"]] for p in parts]).double()
    assert m["objective/scores"] == pytest.approx(kept_scores.mean().item(), rel=1e-6)
    kept_returns = torch.cat([p["rewards"].sum(dim=1)[p["valid"]] for p in parts]).double()
    assert m["objective/rlhf_reward"] == pytest.approx(kept_returns.mean().item(), rel=1e-6)
