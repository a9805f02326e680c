"""Sparsity recipe: L1 schedule and penalty, statistics, dead units, reinit, plots, sweep summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from scripts.summarize_sweep import main as summarize_sweep_main
from sparse_llm.analysis import plots
from sparse_llm.analysis.plots import (
    nnz_hist_figure,
    plot_run,
    plot_runs_overlay,
    plot_val_ce_vs_sparsity,
    settled_layer_l0,
)
from sparse_llm.analysis.runs import read_metrics
from sparse_llm.analysis.sweep import SweepError, summarize_sweep
from sparse_llm.config import ModelConfig, SparsityConfig
from sparse_llm.model import FFNStats, GatedMLP, build_model
from sparse_llm.sparsity import SparsityMonitor, l1_coefficient, l1_penalty, reinit_dead_units


def counts_from_hist(hist: torch.Tensor) -> torch.Tensor:
    """Per-token non-zero counts [L, M] having the histogram `hist` [L, H + 1]."""
    bins = torch.arange(hist.shape[1])
    return torch.stack([torch.repeat_interleave(bins, row) for row in hist])


REPO = Path(__file__).resolve().parents[2]
H, LAYERS = 64, 2


def tiny_cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=97, hidden_size=32, intermediate_size=H, num_hidden_layers=LAYERS, num_attention_heads=2
    )


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(tiny_cfg())


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def capture_gates(model) -> tuple[list[list[torch.Tensor]], list]:
    """Record each layer's raw gate pre-activations [tokens, H] on every forward."""
    gates: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    handles = [
        layer.mlp.gate_proj.register_forward_hook(
            lambda _m, _inp, out, i=i: gates[i].append(out.detach().flatten(0, -2))
        )
        for i, layer in enumerate(model.model.layers)
    ]
    return gates, handles


# --- L1 schedule and penalty ---------------------------------------------------------------


def test_l1_coefficient_schedule():
    cfg = SparsityConfig(l1_coeff=2e-5, l1_warmup_start=10, l1_warmup_end=20)
    assert l1_coefficient(cfg, 0) == 0.0
    assert l1_coefficient(cfg, 9) == 0.0
    assert l1_coefficient(cfg, 10) == 0.0
    assert l1_coefficient(cfg, 15) == pytest.approx(1e-5)
    assert l1_coefficient(cfg, 20) == 2e-5
    assert l1_coefficient(cfg, 10_000) == 2e-5


def test_l1_coefficient_without_warmup():
    assert l1_coefficient(SparsityConfig(l1_coeff=3e-4), 0) == 3e-4
    cfg = SparsityConfig(l1_coeff=3e-4, l1_warmup_start=5, l1_warmup_end=5)
    assert l1_coefficient(cfg, 4) == 0.0
    assert l1_coefficient(cfg, 5) == 3e-4


def test_l1_value_and_gradient_match_hand_computation():
    torch.manual_seed(0)
    mlp = GatedMLP(tiny_cfg())
    x = torch.randn(3, 5, 32)
    _, (l1, _, _) = mlp(x, with_stats=True)
    wg, wu = mlp.gate_proj.weight, mlp.up_proj.weight
    gw_auto, uw_auto = torch.autograd.grad(l1, (wg, wu))

    with torch.no_grad():
        xs = x.reshape(-1, 32).double()
        g, u = xs @ wg.double().T, xs @ wu.double().T
        a = g.clamp(min=0)
        h = a * u
        m = xs.shape[0]
        assert l1.item() == pytest.approx(h.abs().sum(1).mean().item(), rel=1e-5)
        # d|h|/dWg[j] = sign(h) * u * 1[g > 0] * x ;  d|h|/dWu[j] = sign(h) * a * x, averaged over tokens
        sign = h.sign()
        grad_gate = (sign * u * (g > 0)).T @ xs / m
        grad_up = (sign * a).T @ xs / m
    torch.testing.assert_close(gw_auto.double(), grad_gate, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(uw_auto.double(), grad_up, rtol=1e-4, atol=1e-6)


def test_l1_penalty_is_mean_over_layers_of_model_l1():
    model = tiny_model()
    hidden: list[torch.Tensor] = []
    handles = [
        layer.mlp.down_proj.register_forward_pre_hook(lambda _m, inp: hidden.append(inp[0].detach()))
        for layer in model.model.layers
    ]
    ids = torch.randint(0, 97, (2, 7))
    out = model(ids, labels=ids, with_stats=True)
    for handle in handles:
        handle.remove()
    expected = torch.stack([h.flatten(0, -2).abs().sum(-1).mean() for h in hidden]).mean()
    penalty = l1_penalty(out.ffn_stats)
    torch.testing.assert_close(penalty, expected)
    penalty.backward()  # differentiable all the way to the gate weights
    assert model.model.layers[0].mlp.gate_proj.weight.grad.abs().sum() > 0


# --- statistics ----------------------------------------------------------------------------


def test_summary_matches_brute_force_counts():
    model = tiny_model()
    gates, handles = capture_gates(model)
    monitor = SparsityMonitor(LAYERS, H, dead_window_tokens=10**9)
    with torch.no_grad():
        for step in range(2):
            for micro in range(3):
                ids = torch.randint(0, 97, (2, 5 + micro + step))  # micro-batches of unequal size
                monitor.update(model(ids, with_stats=True).ffn_stats)
            monitor.end_step(identity)
    for handle in handles:
        handle.remove()
    metrics = monitor.summary()

    l1_by_hand = []
    for i, layer_gates in enumerate(gates):
        g = torch.cat(layer_gates)
        nnz = (g > 0).sum(-1).numpy()
        key = f"layer_{i:02d}"
        assert metrics[f"l0/{key}"] == pytest.approx(nnz.mean())
        assert metrics[f"sparsity/{key}"] == pytest.approx(1 - nnz.mean() / H)
        for q in (50, 99):
            assert metrics[f"nnz_p{q}/{key}"] == np.percentile(nnz, q, method="inverted_cdf")
        assert metrics[f"nnz_max/{key}"] == nnz.max()
        assert metrics[f"dead/{key}"] == 0.0
        l1_by_hand.append(metrics[f"l1/{key}"])
    assert metrics["l0/mean"] == pytest.approx(np.mean([metrics[f"l0/layer_{i:02d}"] for i in range(LAYERS)]))
    assert metrics["nnz_max/max"] == max(metrics[f"nnz_max/layer_{i:02d}"] for i in range(LAYERS))
    assert metrics["l1/mean"] == pytest.approx(np.mean(l1_by_hand))
    expected_keys = {f"{n}/mean" for n in ("sparsity", "l0", "l1", "dead", "nnz_p50", "nnz_p99")}
    expected_keys |= {"nnz_max/max"}
    names = ("sparsity", "l0", "l1", "dead", "nnz_p50", "nnz_p99", "nnz_max")
    expected_keys |= {f"{n}/layer_{i:02d}" for n in names for i in range(LAYERS)}
    assert set(metrics) == expected_keys


def test_l1_is_token_weighted_across_micro_batches():
    monitor = SparsityMonitor(1, 4, dead_window_tokens=100)
    for l1, tokens in ((1.0, 1), (4.0, 3)):
        hist = torch.zeros(1, 5, dtype=torch.int64)
        hist[0, 0] = tokens
        monitor.update(
            FFNStats(torch.tensor([l1]), counts_from_hist(hist), torch.zeros(1, 4, dtype=torch.int64))
        )
    monitor.end_step(identity)
    assert monitor.summary()["l1/mean"] == pytest.approx((1.0 * 1 + 4.0 * 3) / 4)


def test_summary_window_resets_and_empty_window_raises():
    monitor = SparsityMonitor(1, 4, dead_window_tokens=100)
    with pytest.raises(RuntimeError, match="no completed step"):
        monitor.summary()
    with pytest.raises(RuntimeError, match="without any update"):
        monitor.end_step(identity)
    for active in (4, 0):  # all units on every token, then none
        hist = torch.zeros(1, 5, dtype=torch.int64)
        hist[0, active] = 10
        fired = torch.full((1, 4), 10 if active else 0, dtype=torch.int64)
        monitor.update(FFNStats(torch.zeros(1), counts_from_hist(hist), fired))
        monitor.end_step(identity)
        assert monitor.summary()["l0/mean"] == active


# --- dead units ----------------------------------------------------------------------------


def synthetic_stats(fired_units: list[int], tokens: int, units: int = 4) -> FFNStats:
    fire = torch.zeros(1, units, dtype=torch.int64)
    fire[0, fired_units] = 1
    hist = torch.zeros(1, units + 1, dtype=torch.int64)
    hist[0, 0] = tokens - len(fired_units)
    hist[0, 1] = len(fired_units)
    return FFNStats(torch.zeros(1), counts_from_hist(hist), fire)


def test_dead_counter_semantics():
    monitor = SparsityMonitor(1, 4, dead_window_tokens=20)
    # 10 tokens per step; unit 0 fires every step, unit 1 only in step 1, units 2-3 never.
    monitor.update(synthetic_stats([0, 1], 10))
    monitor.end_step(identity)
    assert monitor.tracker.tokens_since_fired.tolist() == [[0, 0, 10, 10]]
    assert not monitor.dead_mask().any()
    monitor.update(synthetic_stats([0], 10))
    monitor.end_step(identity)
    assert monitor.dead_mask().tolist() == [[False, False, True, True]]
    monitor.update(synthetic_stats([0], 10))
    monitor.end_step(identity)
    assert monitor.dead_mask().tolist() == [[False, True, True, True]]
    assert monitor.summary()["dead/layer_00"] == 0.75
    monitor.reset_units(torch.tensor([[False, False, True, False]]))
    assert monitor.dead_mask().tolist() == [[False, True, False, True]]


class SimulatedAllReduce:
    """Sum over `world` threads, one per rank, in a fixed rank order (like a collective)."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.slots: list[torch.Tensor | None] = [None] * world

    def for_rank(self, rank: int):
        def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait()  # nobody overwrites a slot before everyone has summed
            return total

        return all_reduce_sum


def test_two_ranks_with_accumulation_equal_one_process_on_all_data():
    model = tiny_model()
    # A few units never fire (zero gate rows: relu(0) = 0); others die by chance. Window = 2 steps.
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight[:5] = 0.0
    torch.manual_seed(1)
    steps, accum, tokens_per_micro = 4, 2, 2 * 6
    batches = [[[torch.randint(0, 97, (2, 6)) for _ in range(accum)] for _ in range(2)] for _ in range(steps)]
    window = 2 * 2 * accum * tokens_per_micro
    with torch.no_grad():
        stats = [
            [[model(ids, with_stats=True).ffn_stats for ids in rank] for rank in step] for step in batches
        ]

    single = SparsityMonitor(LAYERS, H, window)
    for step in stats:
        for rank in step:
            for s in rank:
                single.update(s)
        single.end_step(identity)

    ranks = [SparsityMonitor(LAYERS, H, window) for _ in range(2)]
    for step in stats:
        group = SimulatedAllReduce(2)

        def run(rank: int, step=step, group=group) -> None:
            for s in step[rank]:
                ranks[rank].update(s)
            ranks[rank].end_step(group.for_rank(rank))

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    expected_state = single.state_dict()["tokens_since_fired"]
    expected_summary = single.summary()
    assert single.dead_mask().any()
    for monitor in ranks:
        assert torch.equal(monitor.state_dict()["tokens_since_fired"], expected_state)
        summary = monitor.summary()
        assert summary.keys() == expected_summary.keys()
        for key, value in expected_summary.items():
            assert summary[key] == pytest.approx(value, rel=1e-12), key


def test_tracker_state_dict_roundtrip_through_safetensors(tmp_path):
    monitor = SparsityMonitor(1, 4, dead_window_tokens=20)
    for fired in ([0, 1], [0], [0]):
        monitor.update(synthetic_stats(fired, 10))
        monitor.end_step(identity)
    save_file(monitor.state_dict(), tmp_path / "tensors.safetensors")

    resumed = SparsityMonitor(1, 4, dead_window_tokens=20)
    resumed.load_state_dict(load_file(tmp_path / "tensors.safetensors"))
    assert torch.equal(resumed.dead_mask(), monitor.dead_mask())
    for m in (monitor, resumed):  # the next step evolves both identically
        m.update(synthetic_stats([2], 10))
        m.end_step(identity)
    assert torch.equal(resumed.state_dict()["tokens_since_fired"], monitor.state_dict()["tokens_since_fired"])

    with pytest.raises(ValueError, match="shape"):
        SparsityMonitor(2, 4, dead_window_tokens=20).load_state_dict(monitor.state_dict())


# --- reinit --------------------------------------------------------------------------------


def trained_model_and_optimizer(steps: int = 2):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        ids = torch.randint(0, 97, (2, 8))
        out = model(ids, labels=ids, with_stats=True)
        (out.loss + 1e-3 * l1_penalty(out.ffn_stats)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def dead_mask_for_test() -> torch.Tensor:
    dead = torch.zeros(LAYERS, H, dtype=torch.bool)
    dead[0, [3, 17]] = True
    dead[1, [0]] = True
    return dead


def snapshot(model, optimizer):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in model.named_parameters()}
    return params, state


@pytest.mark.parametrize("reset_up_down", [False, True])
def test_reinit_touches_only_dead_rows_and_their_optimizer_state(reset_up_down):
    model, optimizer = trained_model_and_optimizer()
    dead = dead_mask_for_test()
    before_params, before_state = snapshot(model, optimizer)
    revived = reinit_dead_units(model, optimizer, dead, 0.02, reset_up_down, torch.Generator().manual_seed(0))
    assert revived == 3
    after_params, after_state = snapshot(model, optimizer)

    # Which slices of which parameter must change: (name, dim, units)
    touched: dict[str, tuple[int, torch.Tensor]] = {}
    for i in range(LAYERS):
        units = dead[i].nonzero().squeeze(1)
        prefix = f"model.layers.{i}.mlp."
        touched[prefix + "gate_proj.weight"] = (0, units)
        if reset_up_down:
            touched[prefix + "up_proj.weight"] = (0, units)
            touched[prefix + "down_proj.weight"] = (1, units)

    for name, before in before_params.items():
        after = after_params[name]
        if name not in touched:
            assert torch.equal(after, before), name
            assert all(torch.equal(after_state[name][k], v) for k, v in before_state[name].items()), name
            continue
        dim, units = touched[name]
        keep = torch.ones(before.shape[dim], dtype=torch.bool)
        keep[units] = False
        changed_w = after.index_select(dim, units)
        assert not torch.isclose(changed_w, before.index_select(dim, units)).any(), name
        assert changed_w.std().item() == pytest.approx(0.02, rel=0.5)  # a fresh init draw
        assert torch.equal(
            after.index_select(dim, keep.nonzero().squeeze(1)),
            before.index_select(dim, keep.nonzero().squeeze(1)),
        )
        for key, value in before_state[name].items():
            new = after_state[name][key]
            if key == "step":
                assert torch.equal(new, value)
                continue
            assert (new.index_select(dim, units) == 0).all(), (name, key)
            kept = keep.nonzero().squeeze(1)
            assert torch.equal(new.index_select(dim, kept), value.index_select(dim, kept)), (name, key)
    if not reset_up_down:
        assert torch.equal(
            after_params["model.layers.0.mlp.up_proj.weight"],
            before_params["model.layers.0.mlp.up_proj.weight"],
        )


def test_revived_unit_fires_again():
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # no state yet: must still work
    gate = model.model.layers[1].mlp.gate_proj.weight
    with torch.no_grad():
        gate[5] = 0.0  # relu(0) = 0: unit 5 of layer 1 never fires
    ids = torch.randint(0, 97, (4, 16))
    with torch.no_grad():
        assert model(ids, with_stats=True).ffn_stats.fire_counts[1, 5] == 0
    dead = torch.zeros(LAYERS, H, dtype=torch.bool)
    dead[1, 5] = True
    assert reinit_dead_units(model, optimizer, dead, 0.02, False, torch.Generator().manual_seed(0)) == 1
    assert not optimizer.state  # no state was created
    with torch.no_grad():
        assert model(ids, with_stats=True).ffn_stats.fire_counts[1, 5] > 0


def test_reinit_is_deterministic_and_works_on_bf16_weights():
    results = []
    for dtype in (torch.float32, torch.float32, torch.bfloat16):
        model, optimizer = trained_model_and_optimizer(steps=1)
        model.to(dtype)
        reinit_dead_units(
            model, optimizer, dead_mask_for_test(), 0.02, True, torch.Generator().manual_seed(7)
        )
        results.append(model.model.layers[0].mlp.gate_proj.weight[[3, 17]].detach().clone())
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[2].float(), results[0], rtol=1e-2, atol=1e-3)


def test_reinit_rejects_a_mask_of_the_wrong_shape():
    model, optimizer = tiny_model(), None
    with pytest.raises(ValueError, match="shape"):
        reinit_dead_units(
            model, optimizer, torch.zeros(3, H, dtype=torch.bool), 0.02, False, torch.Generator()
        )


# --- end-of-run histogram and plots --------------------------------------------------------


def write_run(run_dir: Path, l1_coeff: float, steps: int = 4, layers: int = 2, val: bool = True) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        f"sparsity:\n  l1_coeff: {l1_coeff}\n  reinit:\n    enabled: false\n"
    )
    with (run_dir / "metrics.jsonl").open("w") as f:
        for step in range(10, 10 * steps + 1, 10):
            record = {"step": step, "loss": 3.0 - step / 100, "tokens_per_s": 1000.0 + step}
            sparsity = min(0.99, 0.5 + l1_coeff * step * 100)
            for name, value in (("sparsity", sparsity), ("dead", 0.01 * step / 10)):
                for i in range(layers):
                    record[f"{name}/layer_{i:02d}"] = value + 0.001 * i
                record[f"{name}/mean"] = value + 0.0005
            for i in range(layers):
                record[f"l0/layer_{i:02d}"] = (1 + i) * 100.0 / step
            if val and step % 20 == 0:
                record["val_loss"] = 3.1 - step / 100 + l1_coeff
            f.write(json.dumps(record) + "\n")
    return run_dir


def test_save_histograms_and_plot_run(tmp_path):
    model = tiny_model()
    monitor = SparsityMonitor(LAYERS, H, dead_window_tokens=100)
    with pytest.raises(RuntimeError, match="no step"):
        monitor.save_histograms(tmp_path)
    with torch.no_grad():
        monitor.update(model(torch.randint(0, 97, (2, 8)), with_stats=True).ffn_stats)
    monitor.end_step(identity)
    monitor.summary()  # run ended on a log step: the last summarised window is saved
    path = monitor.save_histograms(tmp_path)
    data = json.loads(path.read_text())
    assert data["tokens"] == 16 and data["num_units"] == H
    assert [sum(row) for row in data["counts"]] == [16] * LAYERS

    run_dir = write_run(tmp_path / "run", 2e-5)
    path.rename(run_dir / path.name)
    written = plot_run(run_dir)
    assert {p.name for p in written} == {
        "sparsity_per_layer.png",
        "dead_per_layer.png",
        "nnz_hist_per_layer.png",
        "l0_by_layer.png",
    }
    for p in written:
        assert p.read_bytes().startswith(b"\x89PNG") and p.stat().st_size > 1000


def test_settled_layer_l0_averages_the_last_tenth_of_the_logged_steps(tmp_path):
    records = read_metrics(write_run(tmp_path / "run", 2e-5, steps=20))
    settled, last = settled_layer_l0(records)
    assert last == 2  # a tenth of 20 logged steps
    assert settled == pytest.approx([(1 + i) * 100 * (1 / 190 + 1 / 200) / 2 for i in range(2)])
    assert settled_layer_l0([{"step": 1, "loss": 2.0}]) == ([], 0)


def test_plot_runs_overlay(tmp_path):
    runs = [write_run(tmp_path / "l1", 2e-5), write_run(tmp_path / "no_l1", 0.0)]
    out = plot_runs_overlay(runs, tmp_path / "overlay.png", labels=["L1 2e-5", "L1 = 0"])
    assert out.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="labels"):
        plot_runs_overlay(runs, tmp_path / "x.png", labels=["one"])


def test_empty_histogram_bins_are_gaps_and_every_filled_bin_a_marker():
    row = [0, 0, 3, 1, 0, 0, 0, 4, 0]  # bins 4-6 empty between filled ones, and a lone bin 7
    fig = nnz_hist_figure({"counts": [row], "num_units": 8, "tokens": 8})
    (line,) = fig.axes[0].lines
    shares = line.get_ydata()
    assert [i for i, share in enumerate(shares) if np.isnan(share)] == [0, 1, 4, 5, 6, 8]
    assert shares[[2, 3, 7]].tolist() == [3 / 8, 1 / 8, 4 / 8] and line.get_marker() == "."


def test_comparison_plots_label_their_axes_in_words(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    runs = [write_run(tmp_path / "l1", 2e-5), write_run(tmp_path / "no_l1", 0.0)]
    plot_runs_overlay(runs, tmp_path / "overlay.png", key="sparsity/mean")
    plot_val_ce_vs_sparsity([("λ=0", 0.5, 3.0)], tmp_path / "sweep.png")
    labels = [(fig.axes[0].get_xlabel(), fig.axes[0].get_ylabel()) for fig in figures]
    assert labels == [
        ("step", "sparsity (1 - L0 / H), mean of layers"),
        ("sparsity (1 - L0 / H), mean of layers, last logged step", "validation loss (CE), last evaluation"),
    ]


# --- sweep summary -------------------------------------------------------------------------


def script_env() -> dict[str, str]:
    """This environment, with the repository importable (as `pip install -e .` would make it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))
    return env


def test_summarize_sweep_script(tmp_path):
    sweep = tmp_path / "sweep"
    write_run(sweep / "0", 3e-4)
    write_run(sweep / "1", 0.0)
    write_run(sweep / "nested" / "2", 2e-5, val=False)
    (sweep / "not_a_run").mkdir()
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "summarize_sweep.py"), str(sweep), "--out", str(out)],
        capture_output=True,
        text=True,
        env=script_env(),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        "| run | l1_coeff | val CE | sparsity | sparsity, last 10% | L0 | dead | tokens/s |"
    )
    rows = json.loads((out / "sweep_summary.json").read_text())
    assert [r["l1_coeff"] for r in rows] == [0.0, 2e-5, 3e-4]
    first = rows[0]
    assert first["run"] == "1"
    assert first["val_ce"] == pytest.approx(3.1 - 0.4)  # last eval at step 40
    assert first["sparsity"] == pytest.approx(0.5005)
    assert first["dead"] == pytest.approx(0.0405)
    assert first["tokens_per_s"] == pytest.approx(1025.0)  # median of 1010, 1020, 1030, 1040
    assert rows[1]["val_ce"] is None
    assert first["l0"] is None  # these runs log no l0/mean
    assert (out / "sweep_summary.md").read_text().count("\n") == 2 + 3
    assert (out / "sweep_val_ce_vs_sparsity.png").read_bytes().startswith(b"\x89PNG")


def test_sweep_summary_judges_sparsity_on_the_last_tenth(tmp_path):
    from sparse_llm.analysis.sweep import summarize_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("sparsity:\n  l1_coeff: 0.001\n")
    with (run / "metrics.jsonl").open("w") as f:
        for step in range(10, 101, 10):  # the last 10% of 100 steps: steps 90 and 100
            f.write(json.dumps({"step": step, "sparsity/mean": step / 100, "l0/mean": 100.0 - step}) + "\n")
    row = summarize_run(run, tmp_path)
    assert row.sparsity_tail == pytest.approx((0.9 + 1.0) / 2)
    assert row.sparsity == 1.0 and row.l0 == 0.0


def test_summarize_sweep_without_runs(tmp_path, capsys):
    with pytest.raises(SweepError, match="no run directories"):
        summarize_sweep(tmp_path)
    # The script's main in-process (test_summarize_sweep_script runs it as a user does).
    assert summarize_sweep_main([str(tmp_path)]) == 2
    assert "no run directories" in capsys.readouterr().err
