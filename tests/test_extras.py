"""What installs with liandan and what its extras add: training, planning and checkpoints work without any
extra, and a command that needs one it lacks names it in one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import MICRO_MODEL, run_liandan, write_corpus
from liandan.plugins import EXTRAS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def without_extras(tmp_path_factory):
    """An environment for subprocesses in which no module of any extra can be imported (as after `pip
    install liandan` alone): a sitecustomize that marks them missing, in this process's children too."""
    site = tmp_path_factory.mktemp("site")
    blocked = sorted(m for modules in EXTRAS.values() for m in modules)
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({blocked!r}))\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "src")])}


def test_extras_match_pyproject():
    import re

    from liandan.config import read_toml

    extras = read_toml(ROOT / "pyproject.toml")["project"]["optional-dependencies"]
    module_of = {"mlflow_skinny": "mlflow", "protobuf": "google"}  # distributions whose module has another name
    for extra, modules in EXTRAS.items():
        packages = {re.split(r"[<>=!~;\[ ]", p)[0].lower().replace("-", "_") for p in extras[extra]}
        assert {module_of.get(p, p) for p in packages} == set(modules), extra
    assert extras["dev"][0] == f"liandan[{','.join(EXTRAS)}]"  # dev: every extra, and the tools


def test_only_the_pipeline_steps_the_sweep_and_the_lm_eval_bridge_need_an_extra_to_import(without_extras):
    code = (
        "import importlib, pkgutil, liandan\n"
        "for m in pkgutil.walk_packages(liandan.__path__, 'liandan.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        try:\n"
        "            importlib.import_module(m.name)\n"
        "        except ModuleNotFoundError as err:\n"
        "            print(m.name, err.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=without_extras, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.split("\n")[:-1]) == [
        "liandan.data.steps.normalize ftfy",  # a step of `liandan data run`: [data]
        "liandan.evaluate.lm_eval_bridge lm_eval.api",  # [eval]
        "liandan.plan.pruner optuna",  # [sweep]
        "liandan.plan.sweep optuna",
        "liandan.plan.sweep_replay optuna",  # pruners replayed on recorded trials: [sweep]
        "liandan.track.dash.app starlette.applications",  # the web application of `liandan dash`: [dash]
    ]


def test_a_command_that_needs_an_extra_says_which(without_extras, tmp_path):
    done = run_liandan("sweep", tmp_path / "sweep.toml", env=without_extras)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "liandan: error: liandan sweep needs the [sweep] extra: pip install 'liandan[sweep]'\n"
    done = run_liandan("dash", tmp_path, env=without_extras)
    assert done.stderr == "liandan: error: liandan dash needs the [dash] extra: pip install 'liandan[dash]'\n"
    corpus = write_corpus(tmp_path)
    toml = tmp_path / "pipeline.toml"
    toml.write_text(
        f'[pipeline]\noutput = "{tmp_path / "out"}"\n[[inputs]]\nname = "docs"\npaths = ["{corpus}"]\n[[steps]]\nname = "normalize"\n'
    )
    done = run_liandan("data", "run", toml, env=without_extras)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr == "liandan: error: data_step 'normalize' needs the [data] extra: pip install 'liandan[data]'\n"
    done = run_liandan("lm-eval", tmp_path, "--tasks", "hellaswag", env=without_extras)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "liandan: error: liandan lm-eval needs the [eval] extra: pip install 'liandan[eval]'\n"


@pytest.mark.slow
def test_train_and_plan_need_no_extra(without_extras, tmp_path):
    corpus = write_corpus(tmp_path, n_docs=10)
    train = ["train", str(ROOT / "configs" / "tiny.toml"), *MICRO_MODEL, "--train.steps=2",
             "--train.eval_every=0", "--schedule.warmup_steps=1", "--data.tokenizer=byte", f'--data.paths=["{corpus}"]',
             f"--run.output_dir={tmp_path / 'runs'}", "--run.name=core", "--checkpoint.every=2"]  # fmt: skip
    done = run_liandan(*train, env=without_extras)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "runs" / "core" / "checkpoints" / "step-00000002" / "manifest.json").is_file()
    done = run_liandan("plan", ROOT / "configs" / "tiny.toml", env=without_extras)
    assert done.returncode == 0 and "Memory per device" in done.stdout, done.stderr[-3000:]


def test_readme_gives_a_user_install_beside_the_one_ci_runs():
    import re

    readme = (ROOT / "README.md").read_text()
    commands = [line for block in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL) for line in block.splitlines()]
    user = [c for c in commands if c.startswith("pip install -e '.[")]
    assert len(user) == 1, commands
    extras = set(re.fullmatch(r"pip install -e '\.\[([a-z0-9,-]+)\]'", user[0]).group(1).split(","))
    assert extras <= set(EXTRAS)  # each a real extra, none of the test tools'
    assert {"data", "dash", "hf"} <= extras  # the demo, `liandan dash`, exports loaded in transformers
    ci = (ROOT / ".ci" / "run").read_text()
    for said in re.findall(r"^(.+?)\s+# README: (?:install|test)$", ci, re.MULTILINE):
        assert said.strip() in commands  # the commands CI runs are README's, unchanged
