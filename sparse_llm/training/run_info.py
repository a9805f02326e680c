"""What a run ran on (device, software, commit), written next to its metrics so numbers stay traceable."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from sparse_llm.run_files import RUN_INFO_FILE


def git_commit(repo: Path | None = None) -> str:
    """The short commit of `repo` (default: this checkout); $GIT_COMMIT names it for copies
    without git metadata, such as the tree sent to a device machine."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def collect_run_info(device: torch.device, world_size: int) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "world_size": world_size,
        "device": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def write_run_info(run_dir: Path, device: torch.device, world_size: int, parallel: dict[str, Any]) -> None:
    """RUN_INFO_FILE: what the run ran on, and how the model was spread over its processes
    (`Trainer.parallel_setup`), which changes speed and memory but not the config."""
    info = collect_run_info(device, world_size) | {"parallel": parallel}
    (run_dir / RUN_INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
