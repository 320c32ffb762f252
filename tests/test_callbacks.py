"""The registry of training callbacks: callbacks register by name from their own layer; the trainer never
imports them, and `liandan train` registers liandan's own in every process that trains."""

import subprocess
import sys

import pytest

from liandan.config import load_config
from liandan.train import Callback
from liandan.train import callbacks as registry


class Recorder(Callback):
    def __init__(self, name):
        self.name = name


@pytest.fixture
def empty_registry(monkeypatch):
    monkeypatch.setattr(registry, "_FACTORIES", {})


def test_factories_decide_from_the_config_in_registration_order(empty_registry):
    @registry.register_callback("always")
    def always(cfg):
        return Recorder("always")

    @registry.register_callback("when_forecasting")
    def when_forecasting(cfg):
        return Recorder("forecast") if cfg.forecast.every else None

    assert registry.registered_callbacks() == ["always", "when_forecasting"]
    assert [c.name for c in registry.build_callbacks(load_config(None, []))] == ["always"]
    on = load_config(None, ["--forecast.every=5"])
    assert [c.name for c in registry.build_callbacks(on)] == ["always", "forecast"]
    assert [c.name for c in registry.default_callbacks(on)] == ["always", "forecast"]


def test_a_name_registered_twice_is_refused(empty_registry):
    def first(cfg):
        return None

    def second(cfg):
        return Recorder("second")

    registry.register_callback("twice")(first)
    registry.register_callback("twice")(first)  # the same factory again (a module imported twice): fine
    with pytest.raises(ValueError, match="callback 'twice' is registered twice"):
        registry.register_callback("twice")(second)


def test_the_cli_registers_the_forecast_and_the_trainer_imports_no_plan():
    code = (
        "import sys\n"
        "import liandan.train.trainer, liandan.train.callbacks as c\n"
        "assert not [m for m in sys.modules if m.startswith('liandan.plan')], 'the trainer imported plan'\n"
        "assert c.registered_callbacks() == []\n"
        "from liandan.cli.main import register_callbacks\n"
        "register_callbacks()\n"
        "print(c.registered_callbacks())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['forecast']"
