"""What the read-only commands import: real processes, each calling `liandan.cli.main.main` and reporting
which heavy modules it imported. Every CLI call used to import torch, DCP and DTensor before doing anything."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from liandan.checkpoint.verify import write_manifest
from liandan.run import META, step_dir_name

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
HEAVY = ("torch", "torch.distributed.checkpoint", "torch.distributed.tensor")


def imported_by(*argv: str) -> dict:
    """Run `liandan ARGV` in a fresh interpreter: its exit code, which of HEAVY it imported, and its stderr."""
    child = (
        "import json, sys\n"
        "from liandan.cli.main import main\n"
        f"code = main({list(argv)!r})\n"
        "sys.stdout.flush()\n"
        f"print(json.dumps({{'code': code, 'imported': [m for m in {HEAVY!r} if m in sys.modules]}}))\n"
    )
    done = subprocess.run([sys.executable, "-c", child], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


def test_config_keys_and_runs_import_no_torch(tmp_path):
    for argv in (["config", "--keys"], ["runs", str(tmp_path)]):
        result = imported_by(*argv)
        assert (result["code"], result["imported"]) == (0, []), result


def test_plan_and_ckpt_info_import_no_distributed_checkpoint(tmp_path):
    plan = imported_by("plan", str(CONFIGS / "llama-8b.toml"))
    assert plan["code"] == 0 and "torch.distributed.checkpoint" not in plan["imported"], plan
    assert "torch.distributed.tensor" not in plan["imported"], plan
    step = tmp_path / step_dir_name(3)
    step.mkdir()
    (step / META).write_text(json.dumps({"step": 3, "tokens": 96, "world_size": 1, "layout": "dp1"}))
    write_manifest(step)
    info = imported_by("ckpt", "info", str(step))
    assert (info["code"], info["imported"]) == (0, []), info


@pytest.mark.parametrize("command", [["config"], ["runs"], ["ckpt", "info"]])
def test_a_user_error_of_a_light_command_is_one_line_without_torch(tmp_path, command):
    result = imported_by(*command, str(tmp_path / "missing"))
    assert (result["code"], result["imported"]) == (2, []), result
    err = result["stderr"]
    assert err.count("\n") == 1 and err.startswith("liandan: error: ") and "missing" in err, err
