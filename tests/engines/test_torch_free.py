"""`dspark validate`, `dspark serve --dry-run` and `serve --from-plan` run where torch cannot be imported.

Each command runs in a fresh interpreter whose import system refuses torch, transformers, triton and modelopt (a
sys.meta_path finder that raises ImportError), so a module that imports one of them at any depth fails the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ckpt_factory import write_target_config

SRC = Path(__file__).resolve().parents[2] / "src"
BLOCK_HEAVY = """
import importlib.abc, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "triton", "modelopt"):
            raise ImportError(f"{name} is blocked: this command must not import it")

sys.meta_path.insert(0, Refuse())
sys.argv = ["dspark", *sys.argv[1:]]
from dspark_cli.cli import main
main()
"""


def run_blocked(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", BLOCK_HEAVY, *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_validate_imports_no_torch(tmp_path, spec, draft_dir):
    target = write_target_config(tmp_path / "target", spec)
    done = run_blocked("validate", draft_dir, "--target", target, "--json", "-")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["errors"] == 0


def test_serve_dry_run_imports_no_torch(tmp_path, spec, draft_dir):
    target = write_target_config(tmp_path / "target", spec)
    done = run_blocked("serve", "-t", target, "-d", draft_dir, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("vllm serve ") and '"num_speculative_tokens": 4' in done.stdout


def test_serve_from_plan_imports_no_torch(tmp_path, spec, draft_dir):
    target = write_target_config(tmp_path / "target", spec)
    plan = tmp_path / "plan.json"  # as `dspark plan -o` writes it (measure/replay.py PLAN_FORMAT)
    plan.write_text(json.dumps({"format": "dspark-plan/1", "speculative_config": {
        "num_speculative_tokens": 3, "dspark_confidence_threshold": 0.4}}))
    done = run_blocked("serve", "-t", target, "-d", draft_dir, "--from-plan", plan, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert '"num_speculative_tokens": 3' in done.stdout and '"dspark_confidence_threshold": 0.4' in done.stdout
