"""The rooms of `liandan.data`: importing the package, a dedup band job's module or the pipeline's stages loads no
torch; the package's names are re-exported on first use; pipeline steps are plug-ins found by name."""

import subprocess
import sys

import pytest

import liandan.data
from liandan import plugins
from liandan.config import ConfigError
from liandan.data.documents.corpus import Document
from liandan.data.steps.base import Filter, build_step, register

# The modules that load torch: the loader, which only training imports, and what builds on it.
NEEDS_TORCH = {"liandan.data.tokens.loader", "liandan.data.tokens.pairs", "liandan.data.tokens.poison"}


def _imports_in_a_fresh_process(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_package_a_band_job_and_the_stages_import_no_torch():
    out = _imports_in_a_fresh_process(
        "import sys\n"
        "import liandan.data\n"
        "assert 'torch' not in sys.modules, 'liandan.data'\n"
        "import liandan.data.dedup.dedup_bands, liandan.data.dedup.dedup\n"  # what a band job unpickles
        "assert 'torch' not in sys.modules, 'dedup'\n"
        "import liandan.data.pipeline.pipeline, liandan.data.pipeline.stages, liandan.data.pipeline.executor\n"
        "assert 'torch' not in sys.modules, 'pipeline'\n"
        "from liandan.data import Document, TokenStore, read_documents\n"  # torch-free re-exports stay so
        "print('torch' in sys.modules)\n"
    )
    assert out == "False\n"


def test_no_module_of_data_but_the_loader_imports_torch():
    out = _imports_in_a_fresh_process(
        "import importlib, pkgutil, sys, liandan.data\n"
        "for m in pkgutil.walk_packages(liandan.data.__path__, 'liandan.data.'):\n"
        f"    if m.name not in {sorted(NEEDS_TORCH)!r}:\n"
        "        importlib.import_module(m.name)\n"
        "        assert 'torch' not in sys.modules, m.name\n"
        "import liandan.data.tokens.loader\n"
        "print('torch' in sys.modules)\n"
    )
    assert out == "True\n"  # the check above would see torch if anything loaded it


def test_the_package_re_exports_its_names_from_their_rooms():
    from liandan.data.tokens.loader import PackedLoader
    from liandan.data.tokens.store import TokenStore

    assert liandan.data.TokenStore is TokenStore and liandan.data.PackedLoader is PackedLoader
    assert liandan.data.Document is Document
    for name in liandan.data.__all__:
        assert getattr(liandan.data, name).__name__ == name
    assert set(liandan.data.__all__) <= set(dir(liandan.data))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        liandan.data.nothing_here  # noqa: B018


def test_every_built_in_step_is_a_plug_in_that_loads():
    for plugin in plugins.plugins("data_step"):
        step = plugin.load()
        assert step.name == plugin.name and plugin.module.startswith("liandan.data.steps.")


def test_an_unknown_step_is_one_line_naming_the_known_ones():
    with pytest.raises(ConfigError) as err:
        build_step({"name": "gopher_qualty"})
    message = str(err.value)
    assert message.startswith("steps.name = 'gopher_qualty' is not a known data step (did you mean 'gopher_quality'?)")
    assert "\n" not in message and all(name in message for name in plugins.names("data_step"))


def test_a_step_registered_from_python_is_built_by_name():
    @register
    class ShortOnes(Filter):
        """Drops documents shorter than `chars` characters."""

        name = "test_short_ones"

        def __init__(self, chars: int = 5):
            super().__init__()
            self.chars = chars

        def check(self, doc: Document) -> str | None:
            return "short" if len(doc.text) < self.chars else None

    try:
        step = build_step({"name": "test_short_ones", "chars": 3})
        assert isinstance(step, ShortOnes) and "test_short_ones" in plugins.names("data_step")
        kept = list(step([Document("s", "1", "ab"), Document("s", "2", "abcd")]))
        assert [d.doc_id for d in kept] == ["2"] and step.stats.dropped == {"short": 1}
        with pytest.raises(ValueError, match="registered twice"):

            @register
            class Another(ShortOnes):
                name = "test_short_ones"

    finally:
        plugins.unregister("data_step", "test_short_ones")
