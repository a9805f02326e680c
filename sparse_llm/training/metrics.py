"""Metric sinks (a local JSONL file, always; wandb when enabled) and hardware figures (MFU, memory)."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from sparse_llm.config import WandbConfig

# Dense bf16 tensor-core peak per GPU, for MFU. Unknown devices get no MFU rather than a wrong one.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def resolve_wandb_mode(cfg: WandbConfig) -> str:
    if cfg.mode != "auto":
        return cfg.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (
        netrc.is_file() and "api.wandb.ai" in netrc.read_text()
    )
    return "online" if has_key else "offline"


class MetricsLogger:
    """Writes one JSON object per logged step to `<run_dir>/metrics.jsonl` and mirrors it to wandb."""

    def __init__(
        self, run_dir: Path, wandb_cfg: WandbConfig, run_config: dict[str, Any], enabled: bool
    ) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._wandb_run = None
        if not enabled:
            return
        mode = resolve_wandb_mode(wandb_cfg)
        if mode != "disabled":
            import wandb

            self._wandb_run = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.name or run_dir.name,
                tags=list(wandb_cfg.tags),
                dir=str(run_dir),
                mode=mode,
                config=run_config,
                id=_stable_run_id(run_dir),
                resume="allow",
                # wandb's own banner and sync hints (~50 lines) off unless asked for.
                settings=wandb.Settings(silent=wandb_cfg.quiet, quiet=wandb_cfg.quiet),
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb_run is not None:
            self._wandb_run.log(metrics, step=step)

    def truncate_after(self, step: int) -> None:
        """On resume, drop records past the checkpoint so the file reads as one uninterrupted run."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [
            line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def finish(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _stable_run_id(run_dir: Path) -> str:
    """The same run directory maps to the same wandb run, so a resumed run continues its curves."""
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
