import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def liandan_cache_dir(tmp_path_factory):
    """Keep the suite out of the real ~/.cache; one directory for the whole session (and the subprocesses it
    starts, which inherit os.environ) so the CPU peak benchmark runs once rather than per training start."""
    previous = os.environ.get("LIANDAN_CACHE_DIR")
    os.environ["LIANDAN_CACHE_DIR"] = str(tmp_path_factory.mktemp("liandan-cache"))
    yield
    if previous is None:
        os.environ.pop("LIANDAN_CACHE_DIR", None)
    else:
        os.environ["LIANDAN_CACHE_DIR"] = previous
